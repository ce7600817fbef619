"""vLLM's real Scheduler as a self-scheduling subject (vllm:sched, vllm:spec, vllm:async), and its zoos.

Needs vllm, the packages its import chain reaches and einops (`subjects-constraints.txt`, installed
with --no-deps); every test skips with the reason when they are absent. The first subject of a
process builds vLLM's ModelConfig (about 10 s); every later one copies it.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import pytest

from kvledger.engine.ledger.finding import Finding
from kvledger.properties.scheduling_subject import Output
from kvledger.properties.subject import SubjectConfig
from kvledger.subjects import SpecError, parse_spec, probe_all
from kvledger.subjects import vllm_scheduler as vs
from kvledger.subjects.edits import SourceEdit, edited_function

INSTALLED, VERSION, DETAIL = vs.probe()
pytestmark = pytest.mark.skipif(not INSTALLED, reason=f"vllm:sched is not usable here: {DETAIL}")

PS = 4
CFG = SubjectConfig(num_pages=10, page_size=PS, max_seq_len=32, max_running_req=4)
A = list(range(1, 11))  # 10 tokens: two full blocks and two tokens


def _build(spec: str, edits: Sequence[SourceEdit] = (), config: SubjectConfig = CFG) -> vs.VllmSchedulerSubject:
    return vs.build_spec(config, spec, edits)


# -- the specs -----------------------------------------------------------------------------------------------------


def test_the_specs_are_named_builtins_listed_with_their_install_state():
    for name in ("vllm:sched", "vllm:spec", "vllm:async"):
        spec = parse_spec(name)
        assert spec.builtin and spec.name == name
    rows = {name: installed for name, installed, _, _ in probe_all()}
    assert rows["vllm:sched"] and rows["vllm:spec"] and rows["vllm:async"] and rows["vllm"]
    assert parse_spec("vllm").name == "vllm"
    with pytest.raises(SpecError, match="takes no path"):
        parse_spec("vllm:elsewhere")


def test_capabilities_follow_the_scheduler_built():
    sched, spec, asynchronous = (_build(n).capabilities for n in ("vllm:sched", "vllm:spec", "vllm:async"))
    assert sched.schedules and (sched.in_flight, sched.spec_tokens, sched.max_ahead) == (1, 0, 0)
    assert (spec.in_flight, spec.spec_tokens, spec.max_ahead) == (1, vs.SPEC_TOKENS, vs.SPEC_TOKENS + vs.LOOKAHEAD)
    assert (asynchronous.in_flight, asynchronous.spec_tokens) == (vs.ASYNC_DEPTH, 0)
    assert sched.pages == tuple(range(1, CFG.num_pages + 1))  # block 0 is the null block
    assert type(_build("vllm:async").scheduler).__name__ == "AsyncScheduler"


def test_a_fresh_scheduler_has_every_usable_block_free():
    v = _build("vllm:sched").view()
    assert v.free == list(range(1, CFG.num_pages + 1)) and v.requests == {} and v.cached == []
    assert v.counters == {"free_pages": CFG.num_pages} and v.waiting == [] and v.groups == []


def test_a_step_is_planned_from_the_scheduler_output_and_the_queue_is_its_own():
    s = _build("vllm:sched")
    s.submit(1, A, 4)
    s.submit(2, A[:8] + [50, 51], 4)
    assert s.view().waiting == [1, 2]
    plan = s.schedule(6)  # a budget of 6: uid 1's first chunk, nothing left for uid 2
    assert [(x.uid, x.start, x.end, x.hit) for x in plan.scheduled] == [(1, 0, 6, 0)]
    assert s.view().waiting == [2] and len(s.view().requests[1]) == 8  # two blocks for six positions
    s.output({1: Output()})  # a prefill chunk samples nothing
    plan = s.schedule(None)
    # uid 1's last chunk; its allocate_slots files both full blocks before the waiting loop runs,
    # so uid 2, admitted in the same step, hits 8 tokens (their KV is written in this same pass)
    assert [(x.uid, x.start, x.end, x.hit) for x in plan.scheduled] == [(1, 6, 10, None), (2, 8, 10, 8)]
    s.output({1: Output(tokens=(7,)), 2: Output(tokens=(8,))})
    v = s.view()
    assert v.requests[1][:8] == v.requests[2][:8]  # the shared blocks
    s.abort(2)
    s.finish(1)
    v = s.view()
    assert v.requests == {} and sorted(v.free) == list(range(1, CFG.num_pages + 1))


def test_a_refused_head_and_the_victims_are_reported_in_the_scheduler_order():
    small = SubjectConfig(num_pages=6, page_size=PS, max_seq_len=24, max_running_req=4)
    s = _build("vllm:sched", config=small)
    s.submit(1, list(range(1, 9)), 8)  # 2 blocks, may grow to 4
    s.submit(2, list(range(20, 28)), 8)
    s.submit(3, list(range(40, 52)), 4)  # 3 blocks: no room while 1 and 2 hold 4 of 6
    plan = s.schedule(None)
    assert [x.uid for x in plan.scheduled] == [1, 2] and plan.refused == 3 and plan.preempted == ()
    assert s.view().waiting == [3]
    s.output({1: Output(tokens=(9,)), 2: Output(tokens=(29,))})
    for n in range(8):  # decodes fill the pool: the newest running request goes first
        plan = s.schedule(None)
        if plan.preempted:
            break
        s.output({x.uid: Output(tokens=(60 + n,)) for x in plan.scheduled})
    # position 12 needs a fourth block: the newest (uid 2) is preempted, and waits ahead of uid 3
    assert (n, plan.preempted, s.view().waiting) == (4, (2,), [2, 3])


def test_a_stop_ends_the_request_as_a_stop_token_does():
    s = _build("vllm:sched")
    s.submit(1, A, 8)
    s.schedule(None)
    s.output({1: Output(tokens=(5,), stop=True)})
    assert 1 not in s.view().requests and "1" not in s.scheduler.requests
    s.submit(2, A, 8)
    s.schedule(None)
    s.output({2: Output(tokens=(5,))})
    s.schedule(None)
    s.output({2: Output(tokens=(5,), stop=True)})  # the same value sampled before: ended by finish_requests
    assert s.view().requests == {}


def test_speculation_holds_lookahead_slots_and_rolls_rejected_drafts_back():
    s = _build("vllm:spec")
    s.submit(1, A, 12)
    s.schedule(None)
    s.output({1: Output(tokens=(11,), drafts=(12, 13, 14))})
    plan = s.schedule(None)
    (item,) = plan.scheduled
    assert (item.start, item.end, item.drafts) == (10, 11, (12, 13, 14))
    # computed 10 + 1 + 3 drafts, and 3 lookahead slots past them: the whole table shows it
    assert len(s.view().requests[1]) == -(-(14 + vs.LOOKAHEAD) // PS) * PS
    s.output({1: Output(tokens=(12, 99), drafts=(1, 2, 3))})  # one draft accepted, two rejected
    request = s.scheduler.requests["1"]
    assert (request.num_computed_tokens, request.num_tokens) == (12, 13)
    assert len(s.view().requests[1]) == 20  # rejection never shrinks the table


def test_async_scheduling_schedules_the_next_step_before_the_outputs():
    s = _build("vllm:async")
    s.submit(1, A, 6)
    first = s.schedule(None)
    second = s.schedule(None)  # the prompt's output is still in flight
    assert [(x.start, x.end) for x in first.scheduled] == [(0, 10)]
    assert [(x.start, x.end) for x in second.scheduled] == [(10, 11)]
    assert s.scheduler.requests["1"].num_output_placeholders == 2
    s.output({1: Output(tokens=(11,))})
    assert s.scheduler.requests["1"].num_output_placeholders == 1
    s.output({1: Output(tokens=(12,))})
    assert s.scheduler.requests["1"].num_tokens == 12


def test_edits_bind_on_one_subject_only():
    edit = vs.ZOOS["vllm:spec"][0]
    edited, clean = _build("vllm:spec", [edit]), _build("vllm:spec")
    assert "update_from_output" in vars(edited.scheduler) and "update_from_output" not in vars(clean.scheduler)


# -- a trace through the scheduling driver, and the zoos -------------------------------------------------------------

# Decodes with every acceptance count, a step whose budget cuts a verification short, shared
# prefixes, a pool small enough to preempt, a stop and an abort with a step in flight, and steps of
# budget 1 that leave a decoding request out of a batch.
TRACE: List[Dict] = [
    {"op": "submit", "uid": 1, "tokens": A, "max_tokens": 12},
    {"op": "prefill", "budget": 6, "sample": [101]},
    {"op": "prefill", "budget": 64, "sample": [101, 5, 6, 7]},
    {"op": "decode", "sample": [102, 8, 9, 10], "accept": [1]},
    {"op": "decode", "sample": [103, 11, 12, 13], "accept": [0]},
    {"op": "submit", "uid": 2, "tokens": A[:8] + [50, 51, 52], "max_tokens": 10},
    {"op": "prefill", "budget": 64, "sample": [104, 14, 15, 16], "accept": [3]},
    {"op": "prefill", "budget": 3, "sample": [105, 17, 18, 19], "accept": [2]},
    {"op": "decode", "sample": [106, 20, 21, 22], "accept": [0, 3]},
    {"op": "decode", "sample": [107, 23, 24, 25], "accept": [1, 2]},
    {"op": "submit", "uid": 3, "tokens": list(range(60, 72)), "max_tokens": 8},
    *(
        {"op": "decode", "sample": [108 + i, 26 + 3 * i, 27 + 3 * i, 28 + 3 * i], "accept": [i % 4, (i + 3) % 4, i % 3]}
        for i in range(15)
    ),
    {"op": "submit", "uid": 4, "tokens": A[:8] + [80, 81, 82, 83, 84], "max_tokens": 9},
    {"op": "submit", "uid": 5, "tokens": [90, 91, 92, 93, 94], "max_tokens": 9},
    {"op": "prefill", "budget": 64, "sample": [123, 71, 72, 73], "accept": [1, 0, 0]},
    {"op": "decode", "sample": [124, 74, 75, 76], "accept": [2, 1, 0]},
    {"op": "finish", "uid": 4},
    {"op": "decode", "sample": [125, 77, 78, 79], "accept": [0, 1, 0]},
    {"op": "abort", "uid": 5},
    {"op": "decode", "sample": [126, 80, 81, 82], "accept": [1, 0, 2]},
    {"op": "submit", "uid": 6, "tokens": [95, 96, 97], "max_tokens": 9},
    {"op": "submit", "uid": 7, "tokens": [98, 99], "max_tokens": 9},
    {"op": "prefill", "budget": 64, "sample": [128]},
    {"op": "decode", "sample": [129]},
    *({"op": "prefill", "budget": 1, "sample": [130 + i]} for i in range(4)),
    {"op": "decode", "sample": [134]},
]

# what the judge names each edit's first broken invariant, and the operation it breaks at
EXPECTED: Dict[str, Tuple[str, int]] = {
    "vllm-spec-no-rollback": ("12-step-plan", 4),
    "vllm-spec-accepted-counts-bonus": ("12-step-plan", 4),
    "vllm-spec-caches-unverified": ("7-kv-provenance", 6),
    "vllm-spec-drafts-past-budget": ("12-step-plan", 7),
    "vllm-spec-lookahead-counts-drafts": ("11-over-allocation", 4),
    "vllm-async-placeholders-not-resolved": ("12-step-plan", 4),
    "vllm-async-placeholder-for-prefill-chunk": ("12-step-plan", 2),
    "vllm-async-placeholders-count-scheduled-tokens": ("12-step-plan", 3),
    "vllm-async-stale-share-in-outputs": ("subject-raised:AssertionError", 12),
    "vllm-async-last-placeholder-kept": ("12-step-plan", 42),
}


def _drive(spec: str, edits: Sequence[SourceEdit] = ()) -> Tuple[Finding | None, int, List[str]]:
    from kvledger.properties.scheduling_driver import SchedulingDriver

    events: List[str] = []
    subject = _build(spec, edits)
    driver = SchedulingDriver(subject, CFG, on_event=events.append)
    for i, op in enumerate(TRACE):
        op = dict(op)
        if not subject.capabilities.spec_tokens:
            op.pop("accept", None)
        try:
            driver.apply(op)
        except Finding as f:
            return f, i, events
    return None, len(TRACE), events


@pytest.mark.parametrize("spec", ["vllm:sched", "vllm:spec", "vllm:async"])
def test_the_trace_passes_the_real_scheduler_and_reaches_its_states(spec: str):
    finding, _, events = _drive(spec)
    assert finding is None, f"{finding}\n{finding.detail}"
    reached = set(events)
    assert {"hit: prefix hit", "preempt: a running request preempted", "driver: idle after work"} <= reached
    if spec == "vllm:spec":
        assert {
            "spec: a draft rejected",
            "spec: every draft accepted",
            "ahead: a request holds slots past its tokens",
        } <= reached
    if spec == "vllm:async":
        assert "async: a step scheduled before the previous one's outputs" in reached


def test_every_zoo_edit_applies_exactly_once():
    assert len(vs.ZOOS["vllm:spec"]) >= 5 and len(vs.ZOOS["vllm:async"]) >= 5
    new = vs.ZOOS["vllm:spec"] + vs.ZOOS["vllm:async"]
    assert set(EXPECTED) == {e.name for e in new} and len(new) == len(EXPECTED)
    for edit in new:
        assert callable(edited_function(edit))  # raises EditError unless the text occurs once


@pytest.mark.parametrize(
    "spec,edit",
    [(spec, e) for spec in ("vllm:spec", "vllm:async") for e in vs.ZOOS[spec]],
    ids=lambda x: x if isinstance(x, str) else x.name,
)
def test_the_judge_catches_each_zoo_edit(spec: str, edit: SourceEdit):
    finding, at, _ = _drive(spec, [edit])
    assert finding is not None, f"{edit.name} went unnoticed"
    assert (finding.kind, at) == EXPECTED[edit.name], str(finding)


@pytest.mark.parametrize("spec", ["vllm:sched", "vllm:spec", "vllm:async"])
def test_the_ci_profile_runs_clean_on_a_few_sequences(spec: str, tmp_path):
    from kvledger.checker.testing import check_subject

    report = check_subject(spec, examples=8, out_dir=tmp_path)
    assert "passed" in report, report
