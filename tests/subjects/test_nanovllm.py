"""nano-vllm's BlockManager as a subject: the adapter, the f64d821 bug, the zoo.

Needs the shipped snapshots nano-vllm-bb823b3 / nano-vllm-f64d821 (`$KVLEDGER_PEERS` or
../shared/peers) and xxhash; each test skips with the reason when one is absent.
"""

from __future__ import annotations

import importlib.util
import inspect
import random
import sys
from typing import Callable, Dict, List, Sequence, Tuple

import pytest

from kvledger.engine.ledger.ops import InvalidOp
from kvledger.properties.subject import DriverMismatch, Subject, SubjectConfig, SubjectUnavailable
from kvledger.properties.subject_driver import Finding, SubjectDriver, drive
from kvledger.subjects import nanovllm
from kvledger.subjects.edits import SourceEdit, edited_function
from kvledger.subjects.peers import peer_path

FIXED, BUGGY = nanovllm.DEFAULT_COMMIT, nanovllm.BUGGY_COMMIT
CFG = SubjectConfig(num_pages=8, page_size=4, max_seq_len=32)


def _peer(commit: str) -> str:
    if importlib.util.find_spec("xxhash") is None:
        pytest.skip(f"xxhash is not installed ({nanovllm.INSTALL})")
    found = peer_path(nanovllm.PEER, commit)
    if found is None:
        pytest.skip(f"no nano-vllm-{commit} snapshot (set KVLEDGER_PEERS or put it in ../shared/peers)")
    return str(found)


def _build(commit: str, config: SubjectConfig = CFG, edits: Sequence[SourceEdit] = ()) -> nanovllm.NanoVllmSubject:
    return nanovllm.build(config, _peer(commit), edits)


def _computed(s: Subject, uid: int, start: int, end: int, token: int | None) -> List[int]:
    """allocate + computed of one range; the locations the range was written to."""
    assert s.allocate(uid, start, end)
    locations = s.view().requests[uid][start:end]
    s.computed(uid, start, end, token)
    return locations


# -- loading and the protocol ------------------------------------------------------------------------------------


@pytest.mark.parametrize("commit", [FIXED, BUGGY])
def test_probe_and_build_name_the_commit(commit):
    installed, version, detail = nanovllm.probe(_peer(commit))
    assert installed and version == commit, detail
    s = _build(commit)
    assert isinstance(s, Subject) and s.version == commit and s.name == "nanovllm"
    caps = s.capabilities
    assert caps.pages == tuple(range(CFG.num_pages)) and caps.page_size == 4
    assert caps.preempts and caps.chunk_only_first and caps.cached_pages_in_free_pool
    assert not caps.worst_case_admission and not caps.explicit_evict


def test_missing_checkout_is_unavailable(tmp_path):
    installed, _, detail = nanovllm.probe(str(tmp_path))
    assert not installed and "nanovllm/engine/block_manager.py" in detail
    with pytest.raises(SubjectUnavailable, match="not a nano-vllm checkout"):
        nanovllm.build(CFG, str(tmp_path))


def test_page_size_one_is_refused():
    _peer(FIXED)
    with pytest.raises(SubjectUnavailable, match="page size 1"):
        nanovllm.build(SubjectConfig(num_pages=8, page_size=1, max_seq_len=8), _peer(FIXED))


def test_both_versions_coexist_in_one_process():
    before = {name: sys.modules.get(name) for name in ("nanovllm", "nanovllm.engine.block_manager")}
    fixed, buggy = _build(FIXED), _build(BUGGY)
    assert type(fixed.bm) is not type(buggy.bm)
    assert fixed.source.root != buggy.source.root
    assert str(fixed.source.root) in inspect.getfile(type(fixed.bm))
    assert str(buggy.source.root) in inspect.getfile(type(buggy.bm))
    # each copy's block manager uses its own checkout's Sequence, and the real package was never imported
    assert fixed.source.block_manager.Sequence is fixed.source.sequence.Sequence
    assert buggy.source.block_manager.Sequence is not fixed.source.block_manager.Sequence
    assert {name: sys.modules.get(name) for name in before} == before
    # the two versions really differ where the fix is: f64d821 allocates a given block id
    assert list(inspect.signature(buggy.bm._allocate_block).parameters) == ["block_id"]
    assert list(inspect.signature(fixed.bm._allocate_block).parameters) == []


def test_block_size_is_per_subject():
    small = _build(FIXED, SubjectConfig(num_pages=8, page_size=4, max_seq_len=32))
    large = _build(FIXED, SubjectConfig(num_pages=8, page_size=8, max_seq_len=32))
    prompt = list(range(1, 10))
    for s in (small, large):  # interleaved: neither build may change the other's page size
        s.submit(1, prompt, 2)
    for s in (small, large):
        assert s.admit(1, 64) == 0
    pages = {s.block_size: sorted({loc // s.block_size for loc in s.view().requests[1]}) for s in (small, large)}
    assert pages == {4: [0, 1, 2], 8: [0, 1]}
    assert len(small.view().free) == 5 and len(large.view().free) == 6
    assert small.source.sequence.Sequence.block_size == 256  # nano-vllm's class attribute is left alone


def test_view_reads_block_tables_refs_and_hashes():
    s = _build(FIXED)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    s.submit(1, a, 4)
    assert s.admit(1, 64) == 0
    view = s.view()
    # the whole prompt's blocks are taken at admission, in free-queue order
    assert view.requests[1] == list(range(12))[:9] and view.free == [3, 4, 5, 6, 7]
    assert view.page_refs == {0: 1, 1: 1, 2: 1, 3: 0, 4: 0, 5: 0, 6: 0, 7: 0}
    assert view.counters == {"free_pages": 5, "used_pages": 3} and view.cached == []
    _computed(s, 1, 0, 9, 100)
    keys = {e.key: e.locations for e in s.view().cached}
    assert keys == {s.cache_key(a[:4]): tuple(range(0, 4)), s.cache_key(a[:8]): tuple(range(4, 8))}
    assert s.cache_key(a[:8]) == s.cache_key(a[:9]) != s.cache_key(a[:4]) and s.cache_key(a[:3]) is None
    # a second request with the same first block shares it: one block, two references
    s.submit(2, a[:4] + [50, 51], 4)
    assert s.admit(2, 64) == 4
    view = s.view()
    assert view.requests[2][:4] == view.requests[1][:4] and view.page_refs[0] == 2
    s.finish(1)
    s.finish(2)
    view = s.view()
    assert view.page_refs == {p: 0 for p in range(8)} and sorted(view.free) == list(range(8))
    # freed blocks stay cached in the free queue, each table freed last block first; the shared block
    # goes back only with its last holder
    assert view.free[-4:] == [2, 1, 3, 0] and len(view.cached) == 2


def test_chunked_prefill_publishes_each_completed_block():
    s = _build(FIXED)
    a = list(range(1, 11))
    s.submit(1, a, 2)
    assert s.admit(1, 3) == 0
    _computed(s, 1, 0, 3, None)
    assert s.view().cached == []
    _computed(s, 1, 3, 6, None)
    assert [e.key for e in s.view().cached] == [s.cache_key(a[:4])]
    _computed(s, 1, 6, 10, 200)
    assert {e.key for e in s.view().cached} == {s.cache_key(a[:4]), s.cache_key(a[:8])}
    assert len(s.view().requests[1]) == 11  # the sampled token's slot is in the last block
    with pytest.raises(DriverMismatch):  # a decode of the wrong position is the driver's error
        s.allocate(1, 9, 10)


def test_decode_without_room_refuses_then_preempted_request_rehits_its_blocks():
    config = SubjectConfig(num_pages=3, page_size=4, max_seq_len=16)
    s = _build(FIXED, config)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    for uid, prompt in ((1, a), (2, b)):
        s.submit(uid, prompt, 4)
        assert s.admit(uid, 64) == 0
        _computed(s, uid, 0, 4, 10 * uid)
    assert s.allocate(1, 4, 5)  # takes the last free block
    before = s.view()
    assert not s.allocate(2, 4, 5)  # can_append: no block for position 4; nothing changed
    assert s.view() == before
    b_block = before.requests[2][0] // 4
    s.preempt(2)  # Scheduler.preempt: deallocate; the sequence keeps prompt + output
    view = s.view()
    assert 2 not in view.requests and b_block in view.free and view.page_refs[b_block] == 0
    s.computed(1, 4, 5, 11)
    s.finish(1)
    assert s.admit(2, 64) == 4  # prompt + its sampled token: the prompt's own block, still cached
    assert s.view().requests[2][:4] == list(range(b_block * 4, b_block * 4 + 4))
    _computed(s, 2, 4, 5, 21)
    assert len(s.view().requests[2]) == 6


def test_abort_waiting_and_mid_prefill():
    s = _build(FIXED)
    s.submit(1, list(range(1, 10)), 2)
    s.submit(2, [7, 7], 2)
    s.abort(2)  # never admitted: nothing to release
    assert s.admit(1, 4) == 0
    _computed(s, 1, 0, 4, None)
    s.abort(1)
    view = s.view()
    assert view.requests == {} and sorted(view.free) == list(range(8)) and set(view.page_refs.values()) == {0}


# -- the known bug at f64d821 ------------------------------------------------------------------------------------


def _hit_on_free_cached_block(s: Subject) -> Dict[str, object]:
    """A finishes; B hits A's first block (cached, in the free queue) and computes a block of its own
    on top; C's prompt starts with B's second block alone."""
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    b = [1, 2, 3, 4, 20, 21, 22, 23, 24]
    c = [20, 21, 22, 23, 30]
    s.submit(1, a, 1)
    assert s.admit(1, 64) == 0
    _computed(s, 1, 0, 9, 100)
    s.finish(1)
    s.submit(2, b, 4)
    b_hit = s.admit(2, 64)
    b_block = _computed(s, 2, 4, 9, 101)[:4]  # positions 4..7: KV written for the prefix b[:8]
    entry = next(e for e in s.view().cached if tuple(b_block) == e.locations)
    keys = {e.key for e in s.view().cached}
    s.submit(3, c, 4)
    c_hit = s.admit(3, 64)
    return {
        "b_hit": b_hit,
        "b_block_key": entry.key,
        "a_first_cached": s.cache_key(a[:4]) in keys,
        "c_hit": c_hit,
        "c_reads": s.view().requests[3][:4],
        "b_block": b_block,
        "right_key": s.cache_key(b[:8]),
        "alone_key": s.cache_key(b[4:8]),
    }


def test_f64d821_hit_on_a_free_cached_block_refiles_the_next_block():
    good = _hit_on_free_cached_block(_build(FIXED))
    assert good["b_hit"] == 4 and good["b_block_key"] == good["right_key"] and good["a_first_cached"]
    assert good["c_hit"] == 0

    bad = _hit_on_free_cached_block(_build(BUGGY))
    assert bad["b_hit"] == 4  # the hit itself still happens
    # the hit reset the block's hash and dropped A's entry: A's prefix is lost for everyone ...
    assert not bad["a_first_cached"]
    # ... and B's next block chains from -1: filed as if b[4:8] started a prompt
    assert bad["b_block_key"] == bad["alone_key"] != bad["right_key"]
    # so C, which shares no prefix with B, reads B's KV (computed after b[:4]) as its own first block
    assert bad["c_hit"] == 4 and bad["c_reads"] == bad["b_block"]


def test_f64d821_fix_restores_the_fixed_behaviour():
    fixes = nanovllm.FIXES["nanovllm-f64d821-hit-resets-free-block"]
    fixed = _hit_on_free_cached_block(_build(BUGGY, edits=fixes))
    assert fixed == _hit_on_free_cached_block(_build(FIXED))


BUG_OPS = [
    {"op": "submit", "uid": 1, "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9], "max_tokens": 1},
    {"op": "prefill", "budget": 64},
    {"op": "submit", "uid": 2, "tokens": [1, 2, 3, 4, 20, 21, 22, 23, 24], "max_tokens": 2},
    {"op": "prefill", "budget": 64},
    {"op": "submit", "uid": 3, "tokens": [20, 21, 22, 23, 30], "max_tokens": 2},
    {"op": "prefill", "budget": 64},
]


def test_judge_finds_the_f64d821_bug_and_not_the_fix():
    finding, _ = drive(_build(BUGGY), CFG, BUG_OPS)
    assert finding is not None and finding.kind == "7-kv-provenance", finding
    for subject in (_build(FIXED), _build(BUGGY, edits=nanovllm.FIXES["nanovllm-f64d821-hit-resets-free-block"])):
        finding, driver = drive(subject, CFG, BUG_OPS)
        assert finding is None, finding
        assert driver.witness.computed == {2: 9, 3: 5}


# -- the zoo -----------------------------------------------------------------------------------------------------


def _submit(uid: int, tokens: List[int], max_tokens: int) -> dict:
    return {"op": "submit", "uid": uid, "tokens": tokens, "max_tokens": max_tokens}


def _prefill(budget: int = 64) -> dict:
    return {"op": "prefill", "budget": budget}


# zoo name -> (pool pages, the script, the invariant the judge must name on the mutant)
ZOO_SCRIPTS: Dict[str, Tuple[int, List[dict], str]] = {
    "nanovllm-deallocate-skips-first": (8, [_submit(1, [1, 2, 3, 4, 5, 6], 1), _prefill()], "5-quiescence"),
    "nanovllm-can-allocate-counts-last-block": (
        8,
        [_submit(1, list(range(1, 9)), 1), _prefill(), _submit(2, list(range(1, 9)), 1), _prefill()],
        "8-request",
    ),
    # pool of 4: A's 3 blocks return to the free queue (2 cached); C holds 1; D needs 4 blocks, 2 of them
    # hits in the free queue: 4 > 3 free, refused; the edit counts 2 and pops an empty queue
    "nanovllm-can-allocate-free-hit-costs-nothing": (
        4,
        [
            _submit(1, list(range(1, 10)), 1),
            _prefill(),
            _submit(2, [50, 51, 52], 4),
            _prefill(),
            _submit(3, list(range(1, 9)) + list(range(60, 68)), 1),
            _prefill(),
        ],
        "subject-raised:IndexError",
    ),
    "nanovllm-hash-parent-off-by-one": (
        8,
        [_submit(1, list(range(1, 10)), 2), _prefill(4), _prefill()],
        "7-kv-provenance",
    ),
    "nanovllm-may-append-late": (8, [_submit(1, [1, 2, 3, 4], 3), _prefill(), {"op": "decode"}], "8-request"),
    "nanovllm-shared-hit-resets-ref": (
        8,
        [_submit(1, [1, 2, 3, 4, 5, 6], 4), _prefill(), _submit(2, [1, 2, 3, 4, 7, 8], 4), _prefill()],
        "1-2-partition",
    ),
    "nanovllm-free-keeps-used": (8, [_submit(1, [1, 2, 3, 4, 5, 6], 1), _prefill()], "9-counters"),
    # pool of 2: B takes both blocks, among them A's cached first block, and overwrites its KV
    "nanovllm-reuse-keeps-stale-hash": (
        2,
        [_submit(1, [1, 2, 3, 4, 5], 1), _prefill(), _submit(2, [9, 10, 11, 12, 13], 1), _prefill()],
        "7-kv-provenance",
    ),
}


def test_zoo_is_complete_and_applies_to_bb823b3():
    names = [e.name for e in nanovllm.ZOO]
    assert len(names) >= 5 and len(set(names)) == len(names)
    assert set(names) == set(ZOO_SCRIPTS)
    block_manager = _build(FIXED).source.block_manager
    for edit in nanovllm.ZOO:
        edited_function(edit, block_manager)  # EditError unless the text occurs exactly once


@pytest.mark.parametrize("edit", nanovllm.ZOO, ids=lambda e: e.name)
def test_judge_catches_zoo_entry(edit):
    pages, ops, kind = ZOO_SCRIPTS[edit.name]
    config = SubjectConfig(num_pages=pages, page_size=4, max_seq_len=32)
    mutant = _build(FIXED, config, edits=[edit])
    finding, driver = drive(mutant, config, ops)
    assert finding is not None and finding.kind == kind, f"{edit.name}: {finding}"
    # the edit is bound on that instance alone: a fresh build of the same checkout runs clean
    clean, driver = drive(_build(FIXED, config), config, ops)
    assert clean is None, f"{edit.name}: the unedited subject fails the same script: {clean}"
    assert driver.ops == len(ops)


# -- a block shared by two requests can lose its map entry (correct nano-vllm) ------------------------------------

SHARED_UNFILED_OPS = [
    _submit(10, [1, 2, 3, 4, 19, 11, 14, 30], 4),
    _submit(11, [1, 2, 3, 4], 8),
    _submit(14, [1, 2, 3, 4, 5, 6, 7], 2),
    {"op": "prefill", "budget": 7, "sample": [17]},
    {"op": "prefill", "budget": 22, "sample": [7]},
]


def test_a_shared_block_can_lose_its_map_entry_at_bb823b3():
    """hash_to_block_id is last-writer-wins: a one-block prompt is never matched (can_allocate skips
    the last block), so it computes its own copy of a cached block and files it over the entry that
    another request just hit. The shared block's KV stays right; only its map entry moves."""
    s = _build(FIXED)
    s.submit(10, [1, 2, 3, 4, 19, 11, 14, 30], 4)
    s.submit(11, [1, 2, 3, 4], 8)
    s.submit(14, [1, 2, 3, 4, 5, 6, 7], 2)
    assert s.admit(10, 7) == 0
    _computed(s, 10, 0, 7, None)  # publishes block 0 = [1, 2, 3, 4]
    assert s.allocate(10, 7, 8)
    assert s.admit(11, 21) == 0 and s.allocate(11, 0, 4)
    assert s.admit(14, 17) == 4 and s.allocate(14, 4, 7)
    for uid, start, end in ((10, 7, 8), (11, 0, 4), (14, 4, 7)):
        s.computed(uid, start, end, 7)
    view = s.view()
    shared = view.requests[10][:4]
    assert view.requests[14][:4] == shared and view.page_refs[shared[0] // 4] == 2
    key = s.cache_key([1, 2, 3, 4])
    assert s.bm.hash_to_block_id[key] * 4 == view.requests[11][0] != shared[0]  # the map entry moved
    holders = [e for e in view.cached if e.key == key]
    assert {e.locations[0] for e in holders} == {shared[0], view.requests[11][0]}  # both blocks carry it


def test_judge_accepts_a_shared_block_that_lost_its_map_entry():
    finding, _ = drive(_build(FIXED), CFG, SHARED_UNFILED_OPS)
    assert finding is None, finding


# -- a seeded workload through the driver ------------------------------------------------------------------------

PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 6, 7, 8, 1, 2], [3, 3])


def _workload(seed: int, n: int = 120) -> List[dict]:
    rng = random.Random(seed)
    ops, uid = [], 0
    for _ in range(n):
        r = rng.random()
        if r < 0.3:
            uid += 1
            tail = [rng.randint(1, 30) for _ in range(rng.randint(0, 6))]
            prompt = list(rng.choice(PREFIXES))[: rng.randint(2, 8)] + tail
            ops.append(_submit(uid, prompt or [1], rng.randint(1, 8)))
        elif r < 0.6:
            ops.append({"op": "prefill", "budget": rng.randint(1, 24), "sample": [rng.randint(1, 30)]})
        elif r < 0.9:
            ops.append({"op": "decode", "sample": [rng.randint(1, 30), rng.randint(1, 30)]})
        elif r < 0.95:
            ops.append({"op": "finish", "uid": rng.randint(1, max(uid, 1))})
        else:
            ops.append({"op": "abort", "uid": rng.randint(1, max(uid, 1))})
    return ops


def _run_workloads(make: Callable[[], Subject], config: SubjectConfig, seeds: range) -> Tuple[List[Finding], set]:
    findings, events = [], set()
    for seed in seeds:
        driver = SubjectDriver(make(), config, on_event=events.add)
        for op in _workload(seed):
            try:
                driver.apply(op)
            except InvalidOp:
                continue
            except Finding as f:
                findings.append(f)
                break
    return findings, events


def test_seeded_workload_is_clean_at_bb823b3_and_reaches_the_rare_states():
    config = SubjectConfig(num_pages=6, page_size=4, max_seq_len=24)
    findings, events = _run_workloads(lambda: _build(FIXED, config), config, range(40))
    assert findings == [], findings[0]
    for event in (
        "hit: prefix hit",
        "hit: re-hit of cached pages no request holds",
        "prefill: chunked",
        "admission: refused",
        "preempt: a running request preempted",
        "abort: mid-prefill",
    ):
        assert event in events, f"the workload never reached {event!r}"
