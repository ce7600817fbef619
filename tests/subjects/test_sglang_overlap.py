"""`sglang:overlap`: SGLang 0.5.23's overlap event loop over the spec v2 decode (NGRAM, 4 draft tokens,
page 4) with the decode memory check and retract_decode: step N+1 allocated while step N's
accepted runs wait in the result queue, results processed in free groups, the tail held ahead freed
at release, a retraction of a request whose result is queued, and the zoo, each bug caught on its
minimized trace while the clean subject replays it clean.

Needs the installed sglang (the `# sglang` section of subjects-constraints.txt); every test skips
with the reason when it is absent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import pytest

from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.trace import read
from kvledger.properties.subject import SubjectConfig
from kvledger.properties.subject_driver import SubjectDriver, drive
from kvledger.properties.subject_events import EXHAUSTED_AT_DECODE, expected_events
from kvledger.properties.target import config_of
from kvledger.subjects import parse_spec, probe_all, sglang_overlap
from kvledger.subjects.edits import SourceEdit, edited_function

CFG = SubjectConfig(num_pages=24, page_size=4, max_seq_len=40, max_running_req=4)
PROMPT = [1, 2, 3, 1, 2, 3, 0, 1, 2, 3]  # 10 tokens: two full pages and half a page
TRACES = Path(__file__).parent / "sglang_overlap_traces"  # `kvledger zoo --subject sglang:overlap` (fuzz, seed 0)
# what each bug's minimized trace fails with
CAUGHT_AS = {
    "sglang-overlap-reserve-one-step": "8-request",
    "sglang-overlap-alloc-from-committed": "1-2-partition",
    "sglang-overlap-release-tail-to-committed": "11-over-allocation",
    "sglang-overlap-group-page-ids-dropped": "1-2-partition",
    "sglang-overlap-group-page-ids-as-indices": "1-2-partition",
    "sglang-overlap-estimate-one-step": "subject-raised:RuntimeError",
}

pytestmark = pytest.mark.usefixtures("sglang_importable")


def _build(config: SubjectConfig = CFG, edits: Sequence[SourceEdit] = ()) -> sglang_overlap.OverlapSglangSubject:
    return sglang_overlap.build(config, None, edits)


def _submit(uid: int, tokens: List[int], max_tokens: int) -> Dict[str, Any]:
    return {"op": "submit", "uid": uid, "tokens": tokens, "max_tokens": max_tokens}


def _decode(accept: int) -> Dict[str, Any]:
    return {"op": "decode", "sample": [1, 2, 3, 0], "accept": [accept]}


def _lengths(s: sglang_overlap.OverlapSglangSubject, uid: int) -> Tuple[int, int]:
    kv = s.requests[uid].req.kv
    return kv.kv_allocated_len, kv.kv_committed_len


def test_the_spec_is_listed_and_declares_what_sglang_does():
    spec = parse_spec("sglang:overlap")
    assert spec.builtin and spec.page_sizes() == (4,) and spec.zoo() == sglang_overlap.ZOO
    assert "sglang:overlap" in [name for name, *_ in probe_all()]
    s = _build()
    caps = s.capabilities
    # NGRAM's 3 drafts, the 2 x 4 reserve, retract_decode choosing its victims
    assert (caps.spec_tokens, caps.max_ahead, caps.page_size, caps.chooses_victim) == (3, 7, 4, True)
    assert EXHAUSTED_AT_DECODE in expected_events(caps) and s.rare_events == sglang_overlap.OVERLAP_EVENTS
    assert s.scheduler.clip == 2  # sglang:paged's knobs
    with pytest.raises(Exception, match="page size 4"):
        _build(SubjectConfig(num_pages=8, page_size=2, max_seq_len=16))


def test_step_n_plus_1_is_allocated_before_step_n_commits():
    """Each decode step allocates ceil_page(committed + 8) with committed lagging one step: the
    previous step's accepted run is committed only after the step is launched (at its first result).
    A second step finds its slots in the double buffer the first allocated."""
    s = _build()
    events: List[str] = []
    d = SubjectDriver(s, CFG, on_event=events.append)
    d.apply(_submit(0, PROMPT, 16))
    d.apply({"op": "prefill", "budget": 64, "sample": [1]})
    assert _lengths(s, 0) == (10, 10)
    # (accepted drafts, (allocated, committed) after the step): step 1 allocates from 10 and queues
    # its run of 3; step 2 allocates from 10 still (nothing new: 20 covers [13, 17)), then commits 3;
    # step 3 allocates from 13 -> 24, commits step 2's 1; step 4 from 14 -> 24, commits step 3's 4
    walk = [(2, (20, 10)), (0, (20, 13)), (3, (24, 14)), (1, (24, 18))]
    for accept, lengths in walk:
        d.apply(_decode(accept))
        assert _lengths(s, 0) == lengths
        assert len(s.view().requests[0]) == lengths[0]
    assert {sglang_overlap.LAGGED, sglang_overlap.PREFILL_LAGGED} <= set(events)
    assert len(d.witness.tokens[0]) == 10 + 1 + 3 + 1 + 4 + 2  # the driver's tokens run one step ahead
    req = s.requests[0].req
    assert len(req.output_ids) + len(s._launched[0]) == 1 + 3 + 1 + 4 + 2


def test_a_finish_processes_the_queue_and_frees_the_tail_in_one_group():
    """The request ends at step 2: its results are processed and it is released inside one free
    group, whose pages reach the free list (available_size) only at the group's end."""
    s = _build()
    events: List[str] = []
    d = SubjectDriver(s, CFG, on_event=events.append)
    ends: List[Tuple[int, int, int]] = []  # (pages held in the group, available before, after) at each end
    allocator = s.allocator
    end = allocator.free_group_end

    def watched_end() -> None:
        held = sum(int(t.numel()) for t in allocator.free_group) + sum(
            int(t.numel()) for t in allocator.free_page_ids_group
        )
        before = allocator.available_size()
        end()
        ends.append((held, before, allocator.available_size()))

    allocator.free_group_end = watched_end
    d.apply(_submit(0, PROMPT, 5))
    d.apply({"op": "prefill", "budget": 64, "sample": [1]})
    d.apply(_decode(3))  # 4 tokens: 5 in all, the request ends (max_tokens) holding [10, 20)
    assert 0 not in s.requests
    held, before, after = ends[-1]
    assert held and after > before  # released at the group's end, not before
    view = s.view()
    assert len(view.free) * 4 + view.counters["evictable_tokens"] == 24 * 4  # the pool comes back whole
    assert {sglang_overlap.ENDED_AHEAD, sglang_overlap.GROUP_RELEASED} <= set(events)


def test_a_retraction_drops_a_queued_result_and_resumes_with_the_drivers_tokens():
    """Two requests fill 10 pages in decode; the third step's memory check fails and retract_decode
    releases one whose last accepted run is still queued. SGLang's resolve skips it; its resumed
    prompt is the driver's tokens, and it is admitted again and finishes clean."""
    config = SubjectConfig(num_pages=10, page_size=4, max_seq_len=40, max_running_req=4)
    s = _build(config)
    events: List[str] = []
    d = SubjectDriver(s, config, on_event=events.append)
    for op in (_submit(1, list(range(1, 9)), 16), _submit(2, list(range(11, 19)), 16)):
        d.apply(op)
    d.apply({"op": "prefill", "budget": 64, "sample": [1]})
    for _ in range(3):
        assert d.apply(_decode(3)).batch == (1, 2)
    out = d.apply(_decode(3))
    assert out.preempted == (2,) and out.batch == (1,)
    assert {EXHAUSTED_AT_DECODE, sglang_overlap.RETRACTED_QUEUED} <= set(events)
    req = s.requests[2].req
    assert req.is_retracted and list(req.origin_input_ids) + list(req.output_ids) == d.witness.tokens[2]
    for _ in range(8):
        d.apply({"op": "prefill", "budget": 64, "sample": [1]})
        d.apply(_decode(0))
    assert not s.requests and not d.live


def test_a_requeued_last_request_resumes_without_its_abort():
    """Fuzz seed 363, case 5793, minimized: retract_decode finds even the last request does not fit
    and ends it (to_finish = FINISH_ABORT); the driver requeues it. Resumed, its prefill's result must
    not finish it, or its queued verify runs are skipped as a finished request's and the driver's
    next decode finds tokens missing (it raised DriverMismatch: decode [17, 21) with 16 known)."""
    header, ops = read(TRACES / "aborted-last-request-requeued.jsonl")
    config = config_of(header)
    s = _build(config)
    events: List[str] = []
    d = SubjectDriver(s, config, on_event=events.append)
    resumed = 0
    for op in ops:
        d.apply(op)
        r = s.requests.get(1)
        if r is not None and r.phase == "running" and r.req.retraction_count == 1:
            resumed += 1
            assert not r.req.finished() and r.req.to_finish is None
    assert resumed >= 2 and "preempt: a running request preempted" in events and sglang_overlap.LAGGED in events
    assert not s.requests and not d.live
    finding, _ = drive(_build(config), config, ops)
    assert finding is None, finding


def test_a_chunked_abort_releases_before_the_chunk_is_stashed():
    s = _build()
    events: List[str] = []
    d = SubjectDriver(s, CFG, on_event=events.append)
    d.apply(_submit(0, list(range(1, 17)), 4))
    d.apply({"op": "prefill", "budget": 8})
    assert s.chunk_to_stash == 0
    d.apply({"op": "abort", "uid": 0})
    assert sglang_overlap.CHUNK_ABORT in events
    assert sorted(s.view().free) == list(range(1, 25))  # the chunk was never checkpointed


# -- the zoo ------------------------------------------------------------------------------------------------------
def test_zoo_is_complete_and_applies_to_the_installed_version():
    assert set(CAUGHT_AS) == {e.name for e in sglang_overlap.ZOO} and len(sglang_overlap.ZOO) >= 5
    sglang_overlap.load()
    for edit in sglang_overlap.ZOO:
        edited_function(edit)  # EditError if the text is not in the installed source


def _replay(edits: Sequence[SourceEdit], path: Path) -> Finding | None:
    header, ops = read(path)
    config = config_of(header)
    finding, _ = drive(_build(config, edits), config, ops)
    return finding


@pytest.mark.parametrize("edit", sglang_overlap.ZOO, ids=lambda e: e.name)
def test_zoo_bug_is_caught_and_the_clean_subject_passes(edit: SourceEdit):
    path = TRACES / f"{edit.name}.jsonl"
    found = _replay([edit], path)
    assert found is not None and found.kind == CAUGHT_AS[edit.name], found
    clean = _replay([], path)
    assert clean is None, f"{edit.name}: the unedited subject fails the same trace: {clean}"


def test_seeded_cases_find_nothing_and_reach_every_overlap_state():
    """The fuzzer's cases 0-13 (page 4): no finding, and every rare state of the overlap loop, the
    exhausted-pool decode and its retraction among them (measured: case 13 is the first to need a
    page on an exhausted pool, case 10 the first to abort a chunk before its stash)."""
    from kvledger.checker.subject_walk import run_case

    events: set = set()
    for seed in range(14):
        result = run_case(lambda config: sglang_overlap.build(config), seed, (4,))
        assert result.finding is None, f"seed {seed}: {result.finding}\n{result.finding.detail}"
        events |= set(result.events)
    assert sglang_overlap.OVERLAP_EVENTS | {EXHAUSTED_AT_DECODE, "preempt: a running request preempted"} <= events
