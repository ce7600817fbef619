"""vLLM's KVCacheManager as a subject: the adapter against the installed vllm 0.33.0, and its zoo.

Needs vllm and the packages its import chain reaches (`subjects-constraints.txt`, installed with
--no-deps); every test skips with the reason when they are absent.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import pytest

from kvledger.properties.subject import SubjectConfig, View
from kvledger.properties.subject_driver import Finding, SubjectDriver
from kvledger.subjects import vllm
from kvledger.subjects.edits import SourceEdit, edited_function

INSTALLED, VERSION, DETAIL = vllm.probe()
pytestmark = pytest.mark.skipif(not INSTALLED, reason=f"vllm is not usable here: {DETAIL}")

PS = 4
CFG = SubjectConfig(num_pages=6, page_size=PS, max_seq_len=24)
A = list(range(1, 11))  # 10 tokens: two full blocks and two tokens


def _build(config: SubjectConfig = CFG, edits: Sequence[SourceEdit] = ()) -> vllm.VllmSubject:
    return vllm.build(config, None, edits)


def _run(s: vllm.VllmSubject, uid: int, prompt: List[int], *, decode: int = 0, budget: int = 64) -> int:
    """submit, admit and prefill `prompt` in one chunk, then `decode` steps: the hit."""
    s.submit(uid, prompt, decode + 1)
    hit = s.admit(uid, budget)
    assert hit is not None
    assert s.allocate(uid, hit, len(prompt))
    s.computed(uid, hit, len(prompt), 100 + uid)
    for i in range(decode):
        n = len(prompt) + 1 + i
        assert s.allocate(uid, n - 1, n)
        s.computed(uid, n - 1, n, 200 + i)
    return hit


def _pages(view: View, uid: int) -> List[int]:
    return sorted({loc // PS for loc in view.requests[uid]})


def _state(view: View) -> Tuple:
    return (
        list(view.free),
        {u: list(r) for u, r in view.requests.items()},
        sorted((e.locations, e.key) for e in view.cached),
        dict(view.page_refs or {}),
        dict(view.counters),
    )


# -- building and reading the pool -------------------------------------------------------------------------------


def test_probe_names_the_tested_version():
    assert (INSTALLED, VERSION) == (True, vllm.VERSION)


def test_a_fresh_pool_has_every_usable_block_free_and_no_null_block():
    s = _build()
    v = s.view()
    assert s.capabilities.pages == tuple(range(1, CFG.num_pages + 1))  # block 0 is the null block
    assert v.free == list(range(1, CFG.num_pages + 1))
    assert v.counters == {"free_pages": CFG.num_pages}
    assert v.page_refs == {p: 0 for p in range(1, CFG.num_pages + 1)}
    assert v.requests == {} and v.cached == []


def test_blocks_are_filed_when_allocated_and_stay_cached_in_the_free_queue():
    s = _build()
    s.submit(1, A, 4)
    assert s.admit(1, 64) == 0
    v = s.view()
    assert len(v.requests[1]) == len(A)
    held = _pages(v, 1)
    assert len(held) == 3 and not set(held) & set(v.free)
    assert {p: v.page_refs[p] for p in held} == {p: 1 for p in held}
    assert len(v.cached) == 2  # the two full blocks, filed by allocate_slots before any KV is written
    assert s.allocate(1, 0, len(A))  # admission allocated the chunk already
    s.computed(1, 0, len(A), 7)
    for n in (11, 12):
        assert s.allocate(1, n - 1, n)
        s.computed(1, n - 1, n, 8)
    assert len(s.view().cached) == 3  # position 11 completed the third block
    s.finish(1)
    v = s.view()
    assert v.requests == {} and sorted(v.free) == list(range(1, CFG.num_pages + 1))
    assert set(v.page_refs.values()) == {0}
    assert {e.locations[0] // PS for e in v.cached} == set(held)  # cached, and free (LRU reuse)
    # freed tail first: the unhashed blocks go to the head of the queue, the cached ones to its tail
    assert v.free[-3:] == held[::-1]


def test_a_hit_is_in_whole_blocks_and_leaves_the_last_prompt_token():
    s = _build()
    _run(s, 1, A)
    s.finish(1)
    assert _run(s, 2, A[:8]) == 4  # fully cached, but the last token must be computed: one block less
    assert _run(s, 3, A[:9]) == 8
    v = s.view()
    shared = sorted({loc // PS for loc in v.requests[3][:8]})
    assert {p: v.page_refs[p] for p in shared} == {shared[0]: 2, shared[1]: 1}  # uid 2 holds the first


def test_cache_key_is_the_key_the_block_pool_files_under():
    s = _build()
    _run(s, 1, A, decode=2)
    v = s.view()
    row = v.requests[1]
    by_page = {e.locations[0] // PS: e.key for e in v.cached}
    tokens = A + [101, 200]
    assert len(by_page) == 3
    for i in range(3):
        assert by_page[row[i * PS] // PS] == s.cache_key(tokens[: (i + 1) * PS])
        assert s.cache_key(tokens[: (i + 1) * PS + 1]) == s.cache_key(tokens[: (i + 1) * PS])  # whole blocks
    # chained: a different first block changes the second block's key
    assert s.cache_key([0] + tokens[1:8]) != s.cache_key(tokens[:8])
    assert s.cache_key(tokens[:3]) is None


def test_a_refused_admission_changes_nothing_even_with_hits_in_the_free_queue():
    s = _build()
    _run(s, 1, A)
    s.finish(1)  # its two full blocks are cached and free
    _run(s, 2, list(range(50, 58)), decode=1)  # holds 3 blocks: 3 free left, 2 of them cached A blocks
    s.submit(3, A[:8] + list(range(60, 72)), 1)  # 5 blocks: 2 hits that come out of the free queue + 3
    before = _state(s.view())
    assert s.admit(3, 64) is None
    assert _state(s.view()) == before
    assert s.admit(3, 2) is None  # the whole sequence must fit, not only the first chunk
    assert _state(s.view()) == before


def test_a_chunked_prefill_allocates_chunk_by_chunk():
    s = _build()
    s.submit(1, A, 2)
    assert s.admit(1, 5) == 0
    assert len(s.view().requests[1]) == 8  # 5 positions asked: two blocks
    s.computed(1, 0, 5, None)
    assert s.allocate(1, 5, 10)
    assert len(s.view().requests[1]) == 10
    s.computed(1, 5, 10, 3)
    s.abort(1)
    assert sorted(s.view().free) == list(range(1, CFG.num_pages + 1))


def test_no_room_refuses_an_allocation_and_a_preempted_request_hits_its_own_blocks():
    s = _build()
    _run(s, 1, list(range(1, 12)), decode=1)  # 12 tokens, 3 blocks
    _run(s, 2, list(range(30, 41)), decode=1)  # 3 blocks: the pool is full
    before = _state(s.view())
    assert not s.allocate(2, 12, 13)  # its fourth block: no room, nothing changed
    assert _state(s.view()) == before
    s.preempt(2)
    v = s.view()
    assert 2 not in v.requests and len(v.free) == 3
    s.submit(3, list(range(60, 73)), 1)
    assert s.admit(3, 64) is None  # 3 blocks free, but its 13 tokens need 4
    s.abort(3)
    s.finish(1)
    # readmitted with its prompt and output (13 tokens): its three full blocks, freed but cached,
    # are a hit, and a block of uid 1's is evicted for its fourth
    assert s.admit(2, 64) == 12
    assert s.allocate(2, 12, 13)
    s.abort(2)
    v = s.view()
    assert v.requests == {} and len(v.free) == CFG.num_pages and set(v.page_refs.values()) == {0}


def test_the_free_queue_walk_stops_on_a_cycle():
    s = _build()
    blocks = s.pool.blocks
    blocks[3].next_free_block = blocks[2]  # 1 -> 2 -> 3 -> 2 -> ...: a corrupted queue
    free = s.view().free
    assert len(free) == len(blocks) + 1 and free[:4] == [1, 2, 3, 2]


def test_edits_bind_on_one_subject_only():
    edit = next(e for e in vllm.ZOO if e.name == "vllm-free-blocks-frees-shared")
    edited, clean = _build(edits=[edit]), _build()
    assert "free_blocks" in vars(edited.pool) and "free_blocks" not in vars(clean.pool)


# -- the zoo --------------------------------------------------------------------------------------------------------

# One short trace that every edit of the zoo breaks and the real vLLM passes: a chunked prefill,
# decodes, hits on cached blocks in the free queue, a block two requests share freed by one of them,
# a fully cached prompt, an admission refused although the free queue holds its hits, and a prompt
# that reuses (evicts) a cached block.
TRACE: List[Dict] = [
    {"op": "submit", "uid": 1, "tokens": A, "max_tokens": 4},
    {"op": "prefill", "budget": 6, "sample": [101]},
    {"op": "prefill", "budget": 64, "sample": [101]},
    {"op": "decode", "sample": [102]},
    {"op": "decode", "sample": [103]},
    {"op": "decode", "sample": [104]},  # uid 1 ends: 4 blocks back, one of them unhashed
    {"op": "submit", "uid": 2, "tokens": A[:8] + [50, 51, 52], "max_tokens": 2},
    {"op": "submit", "uid": 3, "tokens": A[:8] + [60, 61], "max_tokens": 2},
    {"op": "prefill", "budget": 64, "sample": [105]},  # both hit A's two blocks, from the free queue
    {"op": "finish", "uid": 2},  # uid 3 still holds the shared blocks
    {"op": "finish", "uid": 3},
    {"op": "submit", "uid": 4, "tokens": A[:8], "max_tokens": 1},
    {"op": "prefill", "budget": 64, "sample": [106]},  # fully cached: the hit must stop a block short
    {"op": "submit", "uid": 6, "tokens": list(range(90, 98)), "max_tokens": 3},
    {"op": "prefill", "budget": 64, "sample": [107]},  # holds 2 blocks: 4 free, 2 of them A's hits
    {"op": "submit", "uid": 5, "tokens": A[:8] + list(range(70, 82)), "max_tokens": 1},
    {"op": "prefill", "budget": 64, "sample": [108]},  # 3 new + 2 hits out of the free queue > 4: refused
    {"op": "abort", "uid": 5},
    {"op": "finish", "uid": 6},
    {"op": "submit", "uid": 7, "tokens": [300, 301, 302], "max_tokens": 1},
    {"op": "prefill", "budget": 64, "sample": [109]},  # reuses the LRU cached block, a part of it
]

# what the judge names each edit's first broken invariant
EXPECTED: Dict[str, str] = {
    "vllm-free-blocks-frees-shared": "1-2-partition",
    "vllm-free-blocks-drops-uncached": "1-2-partition",
    "vllm-touch-increments-first": "1-2-partition",
    "vllm-reuse-keeps-stale-hash": "7-kv-provenance",
    "vllm-cache-full-blocks-hash-offset": "7-kv-provenance",
    "vllm-hit-covers-last-token": "8-request",
    "vllm-allocate-new-blocks-floor": "8-request",
    "vllm-admission-ignores-evictable-hits": "subject-raised:ValueError",
    "vllm-free-queue-remove-keeps-count": "9-counters",
}


def _drive(edits: Sequence[SourceEdit] = ()) -> Tuple[Finding | None, List[str]]:
    events: List[str] = []
    driver = SubjectDriver(_build(edits=edits), CFG, on_event=events.append)
    for op in TRACE:
        try:
            driver.apply(op)
        except Finding as f:
            return f, events
    return None, events


def test_the_zoo_trace_passes_the_real_vllm_and_reaches_its_states():
    finding, events = _drive()
    assert finding is None, f"{finding}\n{finding.detail}"
    assert {
        "prefill: chunked",
        "hit: prefix hit",
        "hit: re-hit of cached pages no request holds",
        "admission: refused",
    } <= set(events)


def test_every_zoo_edit_applies_exactly_once():
    assert len(vllm.ZOO) >= 5 and len({e.name for e in vllm.ZOO}) == len(vllm.ZOO)
    assert set(EXPECTED) == {e.name for e in vllm.ZOO}
    for edit in vllm.ZOO:
        assert callable(edited_function(edit))  # raises EditError unless the text occurs once


@pytest.mark.parametrize("edit", vllm.ZOO, ids=lambda e: e.name)
def test_the_judge_catches_each_zoo_edit(edit: SourceEdit):
    finding, _ = _drive([edit])
    assert finding is not None, f"{edit.name} went unnoticed"
    assert finding.kind == EXPECTED[edit.name], str(finding)
