"""Lockstep with speculative decoding: a trace header's `spec_tokens` makes reference and fast
speculate (properties/speculating_scheduler.py), and nothing changes for a trace without it.

Checked here: the header field (written only when set, so every older trace is the same bytes),
a hand-worked speculating trace (lookahead pages, the rollback across a page boundary, the bonus
token, the end on accepted drafts), the refusals, the speculation's own 11-spec checks on a bug that
both sides share (lockstep sees no difference, only the checks can), the speculating machine and
fuzz case clean and each `spec-` bug of fast's zoo caught by both, at a recorded sequence and case."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings

from kvledger import fast, reference
from kvledger.engine.ledger import trace
from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.invariants import InvariantViolation
from kvledger.engine.ledger.ops import InvalidOp
from kvledger.engine.ledger.trace import Header, TraceError
from kvledger.properties.lockstep import Lockstep, replay
from kvledger.properties.speculating_scheduler import SPEC_EVENTS, SpeculatingCacheScheduler
from kvledger.subjects.fast_zoo import SPECULATION_BUGS, patched

HEADER = Header(num_pages=6, page_size=2, cache_type="radix", table_slots=3, max_seq_len=32, spec_tokens=3)


def test_the_header_writes_spec_tokens_only_when_set():
    plain = Header(num_pages=6, page_size=2, cache_type="radix", table_slots=3, max_seq_len=32)
    assert "spec_tokens" not in trace.dumps(plain, [])
    text = trace.dumps(HEADER, [])
    assert '"spec_tokens": 3' in text and trace.loads(text)[0] == HEADER
    with pytest.raises(TraceError, match="spec_tokens must be a non-negative integer"):
        trace.loads(text.replace('"spec_tokens": 3', '"spec_tokens": -1'))
    assert type(Lockstep(plain).ref) is CacheScheduler and type(Lockstep(HEADER).fast) is SpeculatingCacheScheduler


def test_a_speculating_trace_worked_by_hand(noted):
    lock = Lockstep(HEADER)
    lock.apply({"op": "submit", "uid": 0, "tokens": [1, 2, 3], "max_tokens": 9})
    lock.apply({"op": "prefill", "budget": 64, "sample": [5]})  # KV of 0-2 on 2 pages, token 5 sampled
    ref = lock.ref
    req = ref.live[0]
    assert (req.cached_len, req.device_len, len(ref.cm.free_slots)) == (3, 4, 4)
    # drafts 7 8 9 at positions 4-6 (the lookahead: positions 3-6 need pages 1-3), bonus 7; one accepted
    result = lock.apply({"op": "decode", "sample": [7, 8, 9], "accept": [1]})
    assert result.batch == (0,)
    assert list(req.input_ids) == [1, 2, 3, 5, 7, 7]  # draft 7 accepted, the bonus 7 (8 was rejected)
    assert (req.cached_len, req.device_len) == (5, 6)
    assert len(ref.cm.free_slots) == 3  # committed 0-4 holds pages 0-2; page 3 (positions 6-7) went back
    assert "spec: rollback crosses a page boundary" in noted and "spec: a draft rejected" in noted
    # every draft accepted: 3 drafts + the bonus end the request at its 9 tokens (drafts cut to the room)
    lock.apply({"op": "decode", "sample": [4], "accept": [3]})
    assert (req.cached_len, req.device_len) == (9, 10) and list(req.input_ids)[6:] == [4, 4, 4, 4]
    lock.apply({"op": "decode", "sample": [4], "accept": [3]})  # room for 1 draft: cut short, ends at 12 tokens
    assert not ref.live and len(ref.cm.free_slots) + ref.page_stats().cached == 6
    ends = {"spec: every draft accepted", "spec: a request ends on accepted drafts"}
    ends.add("spec: drafts cut short by max_tokens")
    assert ends <= set(noted)


def test_a_bonus_equal_to_the_rejected_draft_is_bumped():
    lock = Lockstep(HEADER)
    lock.apply({"op": "submit", "uid": 0, "tokens": [1, 2, 3], "max_tokens": 9})
    lock.apply({"op": "prefill", "budget": 64, "sample": [5]})
    lock.apply({"op": "decode", "sample": [7], "accept": [0]})  # drafts 7 7 7, bonus 7: the model disagrees
    assert list(lock.ref.live[0].input_ids) == [1, 2, 3, 5, 8]


def test_refusals():
    plain = Lockstep(Header(num_pages=6, page_size=2, cache_type="radix", table_slots=3, max_seq_len=32))
    spec = Lockstep(HEADER)
    for lock in (plain, spec):
        lock.apply({"op": "submit", "uid": 0, "tokens": [1, 2, 3], "max_tokens": 9})
    with pytest.raises(InvalidOp, match="capability spec_tokens"):
        plain.apply({"op": "decode", "sample": [1], "accept": [1]})
    with pytest.raises(InvalidOp, match="accept belongs to a decode"):
        spec.apply({"op": "prefill", "budget": 8, "accept": [1]})
    spec.apply({"op": "prefill", "budget": 8})
    with pytest.raises(InvalidOp, match="none is negative"):
        spec.apply({"op": "decode", "accept": [-1]})


def _both(monkeypatch, cls_name, method, fn):
    for impl in (reference, fast):
        monkeypatch.setattr(getattr(impl, cls_name), method, fn)


def test_a_rollback_both_sides_skip_is_caught_by_the_spec_checks(monkeypatch):
    """Reference and fast agree on a shared bug: only the speculation's own arithmetic sees it."""
    _both(monkeypatch, "CacheManager", "release_rejected", lambda self, req, end: None)
    ops = [
        {"op": "submit", "uid": 0, "tokens": [1, 2, 3], "max_tokens": 9},
        {"op": "prefill", "budget": 64, "sample": [5]},
        {"op": "decode", "sample": [7, 8, 9], "accept": [1]},
    ]
    with pytest.raises(Finding) as e:
        replay(HEADER, ops)
    assert e.value.kind == "reference-invariant:11-spec" and "is not free again" in e.value.message


def test_a_lookahead_page_that_is_not_the_request_s_own_is_caught():
    sched = SpeculatingCacheScheduler(reference, spec_tokens=2, **HEADER.cache_scheduler_args())
    sched.submit(0, [1, 2, 3], 6)
    sched.prefill(64, [5])
    req = sched.live[0]
    req.propose([1, 1])  # positions 3-5: page 1 holds 3, page 2 (4-5) is not allocated yet
    sched.cm.allocate_paged([req])
    sched._check_lookahead([req])
    free = sched.cm.free_slots[0]
    sched.page_table[req.table_idx][4:6] = [free, free + 1]  # the row points at a free page
    with pytest.raises(InvariantViolation, match="its lookahead page at location .* is free"):
        sched._check_lookahead([req])


def _speculating_run(examples):
    """The speculating machine's first `examples` sequences under the loaded profile, unshrunk (a
    failure stops the run at its first failing sequence, as `kvledger check` runs it)."""
    from kvledger.properties.machine_base import Progress
    from kvledger.properties.speculation_machine import run_machine

    progress = Progress()
    chosen = settings(
        settings.default,
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
    )
    run_machine(chosen, progress)
    return progress


def test_the_speculating_machine_is_clean_and_reaches_the_spec_events():
    progress = _speculating_run(160)
    if settings.default.derandomize:
        if not SPEC_EVENTS <= set(progress.reached):
            # Hypothesis draws from the constants of every local module loaded before this test, so
            # under xdist the derandomized sequences depend on which tests the worker ran first; the
            # bound is then the first 480 sequences, whatever ran before (`kvledger check
            # --speculate`, alone, reaches the last of these events at sequence 76)
            progress = _speculating_run(480)
        assert SPEC_EVENTS <= set(progress.reached), sorted(SPEC_EVENTS - set(progress.reached))


@pytest.mark.parametrize("bug", sorted(SPECULATION_BUGS))
def test_each_speculation_bug_is_caught_by_the_machine_and_by_fuzz(bug):
    from kvledger.checker.lockstep_walk import make_case, walk

    with patched(bug):
        with pytest.raises(AssertionError):
            _speculating_run(20)
        caught = None
        for case in range(20):
            lock = Lockstep(make_case(case, speculate=True).header)
            try:
                for _ in walk(case, lock, lambda name: None, lambda: True, speculate=True):
                    pass
            except Finding:
                caught = case
                break
        assert caught is not None, f"{bug}: 20 speculating fuzz cases missed it"
    for _ in walk(
        caught, Lockstep(make_case(caught, speculate=True).header), lambda n: None, lambda: True, speculate=True
    ):
        pass  # the case that caught it is clean without the bug
