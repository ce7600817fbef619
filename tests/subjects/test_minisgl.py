"""mini-sglang 20fcd7f as a subject: the adapter for its API, the open PR #142 bug and its fix, the zoo.

Needs the shipped snapshot mini-sglang-20fcd7f (`$KVLEDGER_PEERS` or ../shared/peers) and msgpack,
pyzmq and apache-tvm-ffi; each test skips with the reason when one is absent.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import List, Sequence

import pytest
import torch

from kvledger.checker.subject_walk import run_case
from kvledger.engine.ledger.ops import InvalidOp
from kvledger.properties.subject import DriverMismatch, Subject, SubjectConfig, SubjectUnavailable
from kvledger.properties.subject_driver import SubjectDriver, drive
from kvledger.properties.subject_workload import draw_shape, next_op
from kvledger.subjects import kvledger_own, minisgl
from kvledger.subjects.edits import EditError, SourceEdit, edited_function
from kvledger.subjects.peers import peer_path

CFG = SubjectConfig(num_pages=16, page_size=2, max_seq_len=32, max_running_req=4)
FIX = minisgl.FIXES["pr142"]


def _peer() -> str:
    installed, _, detail = minisgl.probe()
    if not installed:
        pytest.skip(detail)
    return str(peer_path(minisgl.PEER, minisgl.COMMIT))


def _build(config: SubjectConfig = CFG, edits: Sequence[SourceEdit] = ()) -> Subject:
    return minisgl.build(config, _peer(), edits)


def _run(s: Subject, uid: int, start: int, end: int, token: int | None) -> List[int]:
    """allocate + computed of one range; the locations it was written to."""
    assert s.allocate(uid, start, end)
    locations = s.view().requests[uid][start:end]
    s.computed(uid, start, end, token)
    return locations


def _pages(locations: Sequence[int], ps: int = CFG.page_size) -> set:
    return {loc // ps for loc in locations}


# -- loading and the protocol ------------------------------------------------------------------------------------


def test_probe_and_build_name_the_commit():
    installed, version, detail = minisgl.probe(_peer())
    assert installed and version == minisgl.COMMIT, detail
    s = _build()
    assert isinstance(s, Subject) and s.name == "minisgl" and s.version == minisgl.COMMIT
    caps = s.capabilities
    assert caps.pages == tuple(range(CFG.num_pages)) and caps.page_size == 2
    assert caps.worst_case_admission and caps.explicit_evict
    assert not caps.preempts and not caps.cached_pages_in_free_pool and not caps.lockstep
    assert type(s.cm).__module__ == "minisgl.scheduler.cache"  # mini-sglang's own code, not a copy


def test_missing_checkout_is_unavailable(tmp_path):
    installed, _, detail = minisgl.probe(str(tmp_path))
    assert not installed and "python/minisgl/scheduler/cache.py" in detail
    with pytest.raises(SubjectUnavailable, match="not a mini-sglang checkout"):
        minisgl.build(CFG, str(tmp_path))


def test_pinning_is_dropped_only_inside_the_subject():
    s = _build()
    s.submit(1, [1, 2, 3, 4, 5], 2)
    assert s.admit(1, 64) == 0 and s.allocate(1, 0, 5)  # _write_page_table pins its staging tensors
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="pin"):  # outside the adapter's calls torch is untouched
            torch.empty(2, pin_memory=True)


def test_page_size_is_per_subject():
    small, large = _build(CFG), _build(replace(CFG, page_size=4))
    assert (small.cm.prefix_cache.page_size, large.cm.prefix_cache.page_size) == (2, 4)
    prompt = list(range(1, 10))
    for s in (small, large):  # interleaved: a later build must not change an earlier one's page size
        s.submit(1, prompt, 1)
        assert s.admit(1, 64) == 0
        _run(s, 1, 0, 9, 50)
    assert [len(e.locations) for e in small.view().cached] == [8]
    assert [len(e.locations) for e in large.view().cached] == [8]
    assert len(small.view().free) == 16 - 4 and len(large.view().free) == 16 - 2


def test_view_reads_free_slots_rows_tree_and_counters():
    s = _build()
    a = [1, 2, 3, 4, 5, 6, 7]
    s.submit(1, a, 3)
    assert s.admit(1, 64) == 0
    assert s.view().requests == {1: []}  # admitted, nothing held yet
    assert _run(s, 1, 0, 7, 100) == list(range(7))
    view = s.view()
    # cache_req(finished=False): the prompt's whole pages go into the tree, locked by the request
    assert view.free == list(range(4, 16)) and view.requests == {1: list(range(7))}
    assert [(e.tokens, e.locations, e.lock) for e in view.cached] == [((1, 2, 3, 4, 5, 6), (0, 1, 2, 3, 4, 5), 1)]
    assert view.counters == {"free_pages": 12, "evictable_tokens": 0, "protected_tokens": 6, "available_tokens": 24}
    # a second request hits the whole pages of the shared prefix (never its last prompt token)
    s.submit(2, a[:6] + [9], 2)
    assert s.admit(2, 64) == 6
    assert s.view().requests[2] == list(range(6))
    assert _run(s, 2, 6, 7, 101) == [8]
    assert _run(s, 1, 7, 8, 5) == [7]  # decode: position 7 is in the page position 6 took
    with pytest.raises(DriverMismatch):
        s.allocate(2, 8, 9)  # uid 2 decodes position 7 next
    _run(s, 2, 7, 8, 6)
    s.finish(2)
    view = s.view()
    # uid 2's whole pages [0, 8) are in the tree now (its [6, 8) as a new leaf), nothing of it is held
    assert sorted((e.start, e.tokens[e.start :], e.lock) for e in view.cached) == [
        (0, (1, 2, 3, 4, 5, 6), 1),
        (6, (9, 101), 0),
    ]
    assert view.free == list(range(5, 16)) and list(view.requests) == [1]
    _run(s, 1, 8, 9, 7)  # max_tokens reached: released inside computed, as _process_last_data does
    assert s.view().requests == {}
    s.finish(1)  # the driver's finish is then a no-op
    view = s.view()
    assert all(e.lock == 0 for e in view.cached) and view.counters["protected_tokens"] == 0
    assert sorted(view.free + [loc // 2 for e in view.cached for loc in e.locations[::2]]) == list(range(16))
    # explicit eviction: the evicted indices go back on the free list, as page ids
    free = len(view.free)
    assert s.evict(2) == 2
    view = s.view()
    assert len(view.free) == free + 1 and view.counters["evictable_tokens"] == 8


def test_chunked_prefill_resumes_and_publishes_only_when_the_prompt_is_done():
    s = _build(replace(CFG, num_pages=32))
    a = list(range(1, 12))
    s.submit(1, a, 2)
    s.submit(2, [20, 21, 22], 2)
    assert s.admit(1, 4) == 0
    _run(s, 1, 0, 4, None)  # a ChunkedReq: no token, no cache_req
    assert s.view().cached == [] and s.view().requests[1] == [0, 1, 2, 3]
    # the next step: its next chunk (no second admission), then a request behind it
    _run(s, 1, 4, 8, None)
    assert s.admit(2, 64) == 0  # the driver's order: chunk first; its reservation is counted first
    _run(s, 1, 8, 11, 30)
    _run(s, 2, 0, 3, 31)
    view = s.view()
    assert [e.tokens for e in view.cached] == [tuple(a[:10])] and view.requests[1] == list(range(11))
    # the other order within a step: admit first, the chunk's allocation afterwards
    s.submit(3, list(range(40, 50)), 1)
    s.submit(4, [60, 61], 1)
    assert s.admit(3, 3) == 0
    _run(s, 3, 0, 3, None)
    assert s.admit(4, 64) == 0  # uid 3 ahead took its whole remaining prompt first
    _run(s, 3, 3, 10, 32)
    _run(s, 4, 0, 2, 33)
    assert set(s.view().requests) == {1, 2}


@pytest.mark.parametrize("chunk_first", [True, False], ids=["chunk-first", "admit-first"])
def test_a_request_mid_prefill_is_reserved_before_the_next_admission(chunk_first):
    """schedule_next_batch adds the chunked request (the queue head) before any other: its rest
    of prompt plus output is reserved first, whichever order the driver calls in."""
    s = _build(replace(CFG, num_pages=8))
    s.submit(1, list(range(1, 9)), 2)
    s.submit(2, [20, 21, 22, 23], 2)
    assert s.admit(1, 3) == 0
    _run(s, 1, 0, 3, None)  # 2 pages held, 6 free: 12 tokens; uid 1 still needs 5 + 2
    if chunk_first:
        assert s.allocate(1, 3, 8)
    assert s.admit(2, 59) is None  # 4 + 2 more do not fit beside it
    if not chunk_first:
        assert s.allocate(1, 3, 8)
    s.computed(1, 3, 8, 5)
    assert set(s.view().requests) == {1}


def test_abort_waiting_mid_prefill_and_running_returns_every_page():
    s = _build()
    s.submit(1, list(range(1, 10)), 2)
    s.submit(2, [7, 7, 7], 2)
    s.submit(3, [8, 8, 8, 8, 8], 3)
    s.abort(2)  # never admitted
    assert s.admit(1, 4) == 0
    _run(s, 1, 0, 4, None)
    s.abort(1)  # mid-prefill: PrefillManager.abort_req hands back its chunked request
    assert s.admit(3, 64) == 0
    _run(s, 3, 0, 5, 9)
    s.abort(3)  # running: DecodeManager.abort_req
    view = s.view()
    assert view.requests == {}
    assert sorted(view.free + [loc // 2 for e in view.cached for loc in e.locations[::2]]) == list(range(16))
    assert all(e.lock == 0 for e in view.cached)


# -- the open bug at 20fcd7f: upstream PR #142 ---------------------------------------------------------------------


def _duplicate_prefix(s: Subject) -> dict:
    """A and B share a prefix and prefill in one batch (neither hits); A's cache_req inserts it
    first, so B's cache_req(finished=False) finds its own copy of [0, 6) already cached."""
    shared = [1, 2, 3, 4, 5, 6]
    s.submit(1, shared + [7], 3)
    s.submit(2, shared + [9], 3)
    assert s.admit(1, 64) == 0 and s.allocate(1, 0, 7)
    assert s.admit(2, 57) == 0 and s.allocate(2, 0, 7)
    b_own = s.view().requests[2][:6]
    s.computed(1, 0, 7, 100)
    s.computed(2, 0, 7, 101)
    view = s.view()
    entry = next(e for e in view.cached if e.tokens == tuple(shared))
    return {
        "b_own": b_own,
        "b_row": view.requests[2][:6],
        "cache": list(entry.locations),
        "free": view.free,
        "lock": entry.lock,
    }


def test_pr142_unfixed_row_points_at_freed_pages():
    out = _duplicate_prefix(_build())
    assert out["cache"] != out["b_own"] and out["lock"] == 2
    # the duplicates were freed, and B still reads them: a page both free and in use
    assert out["b_row"] == out["b_own"]
    assert _pages(out["b_row"]) <= set(out["free"])


def test_pr142_fix_points_the_row_at_the_cache():
    out = _duplicate_prefix(_build(edits=FIX))
    assert out["b_row"] == out["cache"] != out["b_own"] and out["lock"] == 2
    assert _pages(out["b_own"]) <= set(out["free"]) and not _pages(out["b_row"]) & set(out["free"])


PR142_OPS = [
    {"op": "submit", "uid": 1, "tokens": [1, 2, 3, 4, 5, 6, 7], "max_tokens": 3},
    {"op": "submit", "uid": 2, "tokens": [1, 2, 3, 4, 5, 6, 9], "max_tokens": 3},
    {"op": "prefill", "budget": 64},
    {"op": "decode"},
    {"op": "decode"},
]


def test_judge_finds_pr142_and_not_the_fix():
    finding, _ = drive(_build(), CFG, PR142_OPS)
    assert finding is not None and finding.kind == "1-2-partition" and "is free, but live uid(s) [2]" in finding.message
    finding, driver = drive(_build(edits=FIX), CFG, PR142_OPS)
    assert finding is None, finding
    assert driver.live == set()


def test_fuzz_finds_pr142_and_the_fixed_build_stays_clean():
    path = _peer()
    found = [run_case(lambda c: minisgl.build(c, path), seed).finding for seed in range(10)]
    assert any(f is not None and f.kind == "1-2-partition" for f in found)
    for seed in range(25):
        result = run_case(lambda c: minisgl.build(c, path, FIX), seed)
        assert result.finding is None, (seed, result.finding)


def test_fixed_build_agrees_with_the_reference_view_for_view():
    """Without pool pressure (mini-sglang reserves tokens where kvledger reserves pages, so their
    refusals differ in a small pool) the fixed mini-sglang and kvledger's model make the same page
    moves: the adapter calls the same API in the same order."""

    def state(driver: SubjectDriver):
        v = driver.view()
        return v.free, v.requests, sorted((e.tokens, e.locations, e.lock) for e in v.cached), v.counters

    path = _peer()
    for seed in range(12):
        rng = random.Random(seed)
        shape = draw_shape(rng)
        shape = replace(shape, config=replace(shape.config, num_pages=200))
        ours = SubjectDriver(minisgl.build(shape.config, path, FIX), shape.config)
        model = SubjectDriver(kvledger_own.build(shape.config, "reference"), shape.config)
        history: List[List[int]] = []
        uid = 0
        for _ in range(40):
            op = next_op(rng, shape, ours, uid, history)
            if op is None:
                continue
            try:
                out = ours.apply(op)
            except InvalidOp:
                continue
            assert model.apply(op) == out, (seed, op)
            assert state(ours) == state(model), (seed, op)
            uid += op["op"] == "submit"


# -- the zoo -----------------------------------------------------------------------------------------------------


def _submit(uid: int, tokens: List[int], max_tokens: int) -> dict:
    return {"op": "submit", "uid": uid, "tokens": tokens, "max_tokens": max_tokens}


PREFILL = {"op": "prefill", "budget": 64}
DECODE = {"op": "decode"}

# per zoo entry: the pool, a short sequence the unedited subject passes, and what the judge finds
ZOO_CASES = {
    "minisgl-cache-req-keeps-old-lock": (
        CFG,
        [_submit(1, [1, 2, 3, 4, 5], 3), PREFILL, _submit(2, [1, 2, 3, 4, 5, 6, 7], 2), PREFILL],
        "1-2-partition",
    ),
    "minisgl-cache-req-tail-unlocked": (CFG, [_submit(1, [1, 2, 3, 4, 5], 3), PREFILL], "1-2-partition"),
    "minisgl-allocate-evicted-token-locations": (
        replace(CFG, num_pages=6),
        [_submit(1, list(range(1, 10)), 1), PREFILL, _submit(2, [5, 5, 5, 5, 5, 5, 5], 1), PREFILL],
        "1-2-partition",
    ),
    "minisgl-allocate-paged-floor": (CFG, [_submit(1, [1, 2, 3], 3), PREFILL, DECODE], "1-2-partition"),
    "minisgl-lazy-free-stays-lazy": (
        CFG,
        [_submit(1, [1, 2, 3, 4, 5], 3), PREFILL, {"op": "abort", "uid": 1}],
        "1-2-partition",
    ),
    "minisgl-radix-insert-aliases-row": (
        CFG,
        [_submit(1, [1, 2, 3, 4, 5], 1), PREFILL, _submit(2, [7, 7, 7, 7, 7], 1), PREFILL],
        "1-2-partition",
    ),
    "minisgl-radix-evict-keeps-size": (
        CFG,
        [_submit(1, [1, 2, 3, 4, 5], 1), PREFILL, {"op": "evict", "tokens": 2}],
        "9-counters",
    ),
    "minisgl-radix-unlock-leaf-only": (
        CFG,
        [_submit(1, [1, 2, 3, 4, 5, 6, 7], 1), PREFILL, _submit(2, [1, 2, 3, 4, 9, 9, 9], 2), PREFILL, DECODE],
        "5-quiescence",
    ),
    "minisgl-radix-match-partial-page": (
        CFG,
        [_submit(1, [1, 2, 3, 4, 5], 1), PREFILL, _submit(2, [1, 2, 3, 9, 9], 2), PREFILL, DECODE],
        "1-2-partition",
    ),
    "minisgl-adder-no-batch-reservation": (
        replace(CFG, num_pages=8),
        [_submit(1, [1, 2, 3, 4, 5, 6], 4), _submit(2, [7, 8, 9, 10, 11, 12], 4), PREFILL, DECODE, DECODE, DECODE],
        "subject-raised:AssertionError",
    ),
}


def test_zoo_edits_apply_exactly_once_and_are_covered():
    _build()  # loads mini-sglang
    assert len(minisgl.ZOO) >= 5 and {e.name for e in minisgl.ZOO} == set(ZOO_CASES)
    assert len({e.name for e in minisgl.ZOO}) == len(minisgl.ZOO)
    for edit in minisgl.ZOO + FIX:
        assert edited_function(edit).__kvledger_edit__ == edit.name
    with pytest.raises(EditError, match="not a method of"):
        _build(edits=(SourceEdit("x", "minisgl.scheduler.cache:_write_page_table", "offset", "offset", "x"),))


@pytest.mark.parametrize("edit", minisgl.ZOO, ids=lambda e: e.name)
def test_judge_catches_each_zoo_edit(edit):
    config, ops, kind = ZOO_CASES[edit.name]
    finding, _ = drive(_build(config), config, ops)
    assert finding is None, finding
    finding, _ = drive(_build(config, (edit,)), config, ops)
    assert finding is not None and finding.kind == kind, (edit.name, finding)


def test_zoo_edit_is_bound_on_one_instance_only():
    edited, plain = _build(edits=(minisgl.ZOO[1],)), _build()
    assert "cache_req" in vars(edited.cm) and "cache_req" not in vars(plain.cm)
    assert type(edited.cm) is type(plain.cm)
    for s in (edited, plain):
        s.submit(1, [1, 2, 3, 4, 5], 3)
        s.admit(1, 64)
        _run(s, 1, 0, 5, 9)
    assert [e.lock for e in edited.view().cached] == [0] and [e.lock for e in plain.view().cached] == [1]
