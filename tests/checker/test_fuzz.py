"""The random-walk differential fuzzer: quiet on the real code, fast to catch a zoo bug,
reproducible from its seed."""

import math

import pytest

from kvledger.checker.fuzz import format_summary, fuzz
from kvledger.checker.lockstep_walk import PAGE_SIZES, RESERVE_RATIOS, case_seed, case_trace, make_case, walk
from kvledger.checker.workloads import workload_for
from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.engine.ledger.ops import Submit
from kvledger.engine.ledger.trace import read
from kvledger.properties.lockstep import Finding, Lockstep, replay
from kvledger.reference.pages import tokens_to_finish
from kvledger.subjects.fast_zoo import Bug, patched

BUG = "no-remap-on-duplicate"


def test_fuzz_finds_nothing_on_the_real_code_and_reports_throughput(tmp_path):
    result = fuzz(600, workers=2, seed=11, out_dir=tmp_path, progress=False, max_cases=6)
    if result.cases < 12:  # only the safety net's wall clock stops a run short: never the verdict
        pytest.skip(f"the machine ran {result.cases} of 12 cases in 600 s")
    assert result.failure is None and result.exit_code == 0
    assert result.ops > 0 and result.ops_per_s > 0
    assert "prefill: chunked" in result.events
    assert not list(tmp_path.iterdir())
    summary = format_summary(result)
    assert "no finding" in summary and "ops/s" in summary


def test_fuzz_catches_a_zoo_bug_and_writes_a_minimized_trace(tmp_path):
    # counted: the seed's first 40 cases, a minimization of at most 400 replays (the seconds are a
    # safety net that could only end the run early, which skips)
    result = fuzz(
        600,
        workers=1,
        seed=0,
        out_dir=tmp_path,
        bug=BUG,
        progress=False,
        max_cases=40,
        minimize_budget=math.inf,
        minimize_replays=400,
    )
    failure = result.failure
    if failure is None and result.cases < 40:
        pytest.skip(f"the machine ran {result.cases} of 40 cases in 600 s")
    assert failure is not None and result.exit_code == 1
    assert result.seconds_to_find is not None
    assert failure.trace_path.exists() and failure.minimized_path is not None
    header, ops = read(failure.minimized_path)
    assert header.producer == "minimize" and len(ops) <= 10
    with patched(BUG):
        try:
            replay(header, ops)
        except Finding as e:
            assert e.kind == failure.kind == failure.minimized_kind
        else:
            raise AssertionError("the minimized trace does not diverge")
    assert f"kvledger replay {failure.minimized_path}" in format_summary(result)


def test_cases_come_from_the_seed_alone():
    assert case_seed(0, 1, 5) == case_seed(0, 1, 5)
    assert len({case_seed(0, w, c) for w in range(3) for c in range(50)}) == 150
    a = make_case(case_seed(3, 0, 2))
    assert a == make_case(case_seed(3, 0, 2))
    assert case_trace(3, 0, 2, max_ops=120) == case_trace(3, 0, 2, max_ops=120)


def test_cases_cover_the_edges():
    cases = [make_case(case_seed(0, 0, c)) for c in range(300)]
    headers = [c.header for c in cases]
    assert {h.page_size for h in headers} == set(PAGE_SIZES)
    assert {h.cache_type for h in headers} == {"radix", "naive"}
    assert min(h.num_pages for h in headers) == 1
    assert any(c.budgets[0] == 1 for c in cases)  # chunking
    assert all(h.max_seq_len % h.page_size == 0 for h in headers)
    assert all(100 <= c.length <= 500 for c in cases)
    assert {h.admission for h in headers} == {"reserve", "optimistic"}
    assert {h.reserve_ratio for h in headers if h.admission == "optimistic"} == set(RESERVE_RATIOS)
    assert all(h.reserve_ratio == 0.5 for h in headers if h.admission == "reserve")  # the header's default


def test_forcing_the_policy_keeps_the_rest_of_the_case():
    """The policy is drawn last: a case drawn reserve is the case it was before optimistic
    admission existed, and forcing the policy a case would have drawn anyway changes nothing."""
    for c in range(40):
        cseed = case_seed(0, 0, c)
        drawn = make_case(cseed)
        assert make_case(cseed, drawn.header.admission) == drawn
    with pytest.raises(ValueError, match="admission must be one of"):
        make_case(0, "adaptive-or-whatever")


def test_optimistic_cases_submit_only_what_fits_the_pool_and_replay():
    for c in range(6):
        header, ops = case_trace(0, 0, c, admission="optimistic")
        assert header.admission == "optimistic"
        pool = header.num_pages * header.page_size
        submits = [op.op for op in ops if isinstance(op.op, Submit)]
        assert submits and all(
            tokens_to_finish(0, len(op.tokens) + op.max_tokens, header.page_size) <= pool for op in submits
        )
        assert replay(header, ops).step == len(ops)


def test_a_fuzz_run_over_optimistic_cases_preempts(tmp_path):
    """Counted, not timed: each worker runs exactly `max_cases` cases (the time limit is only a
    safety net), so the counts below are those of fixed cases and move only with the code."""
    result = fuzz(120, workers=1, seed=1, out_dir=tmp_path, progress=False, admission="optimistic", max_cases=12)
    assert result.failure is None and result.exit_code == 0
    assert result.cases == result.optimistic_cases == 12
    assert result.preemptions >= 15
    assert {
        "preempt: running request",
        "preempt: mid-chunk",
        "preempt: re-prefill hits the prefix cache",
        "fuzz: preemption in a decode step",
    } <= set(result.events)
    assert f"12 complete cases, {result.preemptions:,} requests preempted" in format_summary(result)


def test_a_case_trace_replays_identically():
    """The case's walk, then (an optimistic case) the drain: prefills and decodes until every
    request ended."""
    header, ops = case_trace(0, 0, 0)
    length = make_case(header.seed).length
    assert header.policy.preempts and len(ops) > length
    assert {op.name for op in ops[length:]} <= {"prefill", "decode"}
    lock = replay(header, ops)
    assert lock.step == len(ops)
    assert not lock.ref.waiting and not lock.ref.live


def test_cli_rejects_an_unknown_bug(capsys):
    from kvledger.cli import main

    assert main(["fuzz", "--seconds", "1", "--bug", "no-such-bug"]) == 2
    assert "unknown bug" in capsys.readouterr().err


def test_an_operation_past_its_time_limit_is_a_hang():
    """The fuzzer's per-operation limit interrupts an operation that never returns (a buggy
    method looping forever) instead of hanging the worker."""
    import time

    from kvledger.checker.fuzz_case import OpTimeout, limited_steps

    def steps():
        yield
        yield
        while True:  # the third operation never finishes
            time.sleep(0.01)

    done = 0
    with pytest.raises(OpTimeout):
        for _ in limited_steps(steps(), 0.3):
            done += 1
    assert done == 2
    assert list(limited_steps(iter([None, None]), 0.3)) == [None, None]  # quick steps pass through


def test_fuzz_reports_a_hang_with_its_trace(tmp_path, monkeypatch):
    """A worker whose operation hangs reports it; the parent writes the trace and exits 1."""
    import torch

    import kvledger.checker.fuzz as fz
    import kvledger.checker.lockstep_walk as lw
    from kvledger.checker.targets import lockstep_target
    from kvledger.reference import events

    # _worker is a process entry point: keep what it sets process-wide from leaking into other tests
    monkeypatch.setattr(events, "_listener", events._listener)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    real_walk = lw.walk

    def hanging_walk(*args, **kwargs):
        for i, step in enumerate(real_walk(*args, **kwargs)):
            if i == 5:
                while True:
                    pass
            yield step

    monkeypatch.setattr(lw, "walk", hanging_walk)

    class Inbox:
        def __init__(self):
            self.items = []

        def put(self, msg):
            self.items.append(msg)

    class Never:
        def is_set(self):
            return False

    inbox = Inbox()
    fz._worker(0, fz.TargetRecipe(None), 0, 1, 30.0, inbox, Never(), op_limit=0.5)
    hang = [m for m in inbox.items if isinstance(m, fz.WorkerFailure) and m.kind == "hang"]
    assert len(hang) == 1 and "ran past 0.5 s" in hang[0].detail
    target = lockstep_target()
    failure = fz.handle_failure(hang[0], target, workload_for(target), tmp_path, 0, 1.0, progress=False)
    assert failure.kind == "hang" and failure.trace_path.exists()
    result = fz.FuzzResult(10, 0, 1.0, 1, 0, failures=[failure])
    assert result.exit_code == 1 and "HANG" in fz.format_summary(result)


# -- what the walk judges besides the comparison: refusals and liveness ---------------------------
# Bugs of the cache scheduler, the driver both sides share: reference and fast agree on every
# operation, so only these checks can see them (as the Hypothesis machine's `invalid` and `drain`
# rules do). Each is an edit of the live method, built as the zoo builds its bugs.
REFUSAL_KEEPS_ADMISSION = Bug(
    "refusal-keeps-admission",
    "test",
    "a prefill refused for its stop does not roll back the admission it ran",
    CacheScheduler,
    "prefill",
    (("checkpoint.restore()", "pass  # BUG: the refusal keeps what admission did"),),
)
PREEMPTED_NEVER_READMITTED = Bug(
    "preempted-never-readmitted",
    "test",
    "admission turns away a preempted request at the head of the queue, so it waits forever",
    CacheScheduler,
    "admit",
    (
        (
            "fresh = pending.chunked_req is None",
            "fresh = pending.chunked_req is None\n"
            "        if fresh and pending.uid in self._preempted:\n"
            "            break  # BUG: a preempted request is never admitted again",
        ),
    ),
)


def _first_finding(bug: Bug, monkeypatch, cases: int, admission=None):
    """The first Finding of seed 0's first `cases` cases (worker 0), `bug` patched in here."""
    [(cls, attr, value)] = bug.patches()
    monkeypatch.setattr(cls, attr, value)
    for k in range(cases):
        cseed = case_seed(0, 0, k)
        lock = Lockstep(make_case(cseed, admission).header)
        try:
            for _ in walk(cseed, lock, lambda name: None, lambda: True, admission=admission):
                pass
        except Finding as e:
            return k, e
    return None, None


def test_the_walk_judges_a_refusal_that_changed_state(monkeypatch):
    case, finding = _first_finding(REFUSAL_KEEPS_ADMISSION, monkeypatch, 20)
    assert finding is not None, "a refused prefill that kept its admission escaped 20 cases"
    assert finding.kind == "refusal:prefill" and "changed the reference's state" in finding.message


def test_the_walk_judges_liveness_under_optimistic_admission(monkeypatch):
    case, finding = _first_finding(PREEMPTED_NEVER_READMITTED, monkeypatch, 20, admission="optimistic")
    assert finding is not None, "a preempted request that waits forever escaped 20 optimistic cases"
    assert finding.kind == "liveness"


def test_the_walk_finds_nothing_of_either_kind_on_the_real_code():
    for admission in ("optimistic", "reserve"):
        for k in range(4):
            cseed = case_seed(5, 0, k)
            lock = Lockstep(make_case(cseed, admission).header)
            for _ in walk(cseed, lock, lambda name: None, lambda: True, admission=admission):
                pass
            assert not lock.ref.waiting and not lock.ref.live or admission == "reserve"


class _NeverReadmitted:
    """A subject that, once it preempted a request, turns it away at every admission after: a
    preempted request waits forever (the refusal itself changes nothing, as the protocol asks)."""

    def __init__(self, inner) -> None:
        self._inner, self._preempted = inner, set()

    def preempt(self, uid: int) -> None:
        self._preempted.add(uid)
        self._inner.preempt(uid)

    def admit(self, uid: int, budget: int):
        return None if uid in self._preempted else self._inner.admit(uid, budget)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def test_the_subject_fuzzer_judges_liveness_of_a_subject_that_preempts():
    """A preempting subject's preempted request that is never admitted again ends no drain: a
    `liveness` finding (before, the drain stopped there quietly). The same seeds find nothing on
    the subject as it is."""
    from kvledger.checker.subject_walk import run_case
    from kvledger.subjects import parse_spec

    spec = parse_spec("nanovllm")
    factory = spec.factory(())
    kinds = [run_case(lambda c: _NeverReadmitted(factory(c)), seed, spec.page_sizes()).finding for seed in range(30)]
    assert any(f is not None and f.kind == "liveness" for f in kinds), [f and f.kind for f in kinds]
    first = next(seed for seed, f in enumerate(kinds) if f is not None)
    assert run_case(factory, first, spec.page_sizes()).finding is None
