"""SGLang 0.5.23's tree cache and paged allocator as a subject: the adapter, its view, the zoos of
`sglang` (the default UnifiedRadixCache) and `sglang:radix` (the classic RadixCache).

Needs the installed sglang and the extras its cache's import chain reaches (the `# sglang`
section of subjects-constraints.txt); every test skips with the reason when they are absent.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Dict, List, Sequence, Tuple

import pytest

from kvledger.properties.subject import Subject, SubjectConfig, SubjectUnavailable
from kvledger.properties.subject_driver import drive
from kvledger.subjects import sglang
from kvledger.subjects.edits import EditError, SourceEdit, edited_function

CFG = SubjectConfig(num_pages=8, page_size=4, max_seq_len=32)
A = list(range(1, 11))  # a 10-token prompt: two full pages and half a page


pytestmark = pytest.mark.usefixtures("sglang_importable")


def _build(config: SubjectConfig = CFG, edits: Sequence[SourceEdit] = (), spec: str = "sglang") -> sglang.SglangSubject:
    return sglang.build_spec(config, spec, edits)


def _run(s: Subject, uid: int, start: int, end: int, token: int | None) -> List[int]:
    """allocate + computed of one range; the locations the range was written to."""
    assert s.allocate(uid, start, end)
    locations = s.view().requests[uid][start:end]
    s.computed(uid, start, end, token)
    return locations


def _entries(s: Subject) -> Dict[Tuple[int, ...], Tuple[Tuple[int, ...], int]]:
    return {e.tokens: (e.locations, e.lock) for e in s.view().cached}


# -- loading ---------------------------------------------------------------------------------------------------


def test_probe_and_build():
    installed, version, detail = sglang.probe()
    assert installed and version == sglang.VERSION, detail
    s = _build()
    assert isinstance(s, Subject) and s.name == "sglang" and s.version == sglang.VERSION
    # the tree the scheduler builds by default: UnifiedRadixCache, full attention only
    assert type(s.tree).__name__ == "UnifiedRadixCache" and type(s.tree.tree_core).__name__ == "UnifiedTreeCore"
    assert s.tree.tree_components == (sglang.load().ComponentType.FULL,)
    assert int(sglang.load().ComponentType.FULL) == sglang.FULL_INDEX
    radix = _build(spec="sglang:radix")
    assert type(radix.tree).__name__ == "RadixCache" and radix.name == "sglang:radix"
    caps = s.capabilities
    # page 0 is SGLang's padding page: the pool's pages are 1..num_pages, all free at first
    assert caps.pages == tuple(range(1, 9)) and caps.page_size == 4
    assert sorted(s.view().free) == list(caps.pages)
    assert caps.preempts and caps.explicit_evict and not caps.worst_case_admission
    assert not caps.cached_pages_in_free_pool
    with pytest.raises(SubjectUnavailable, match="takes no path"):
        sglang.build(CFG, "/somewhere")


def test_import_leaves_no_torchvision_stand_in():
    if importlib.util.find_spec("torchvision") is None:
        assert not [m for m in sys.modules if m.startswith("torchvision")]


def test_a_fresh_process_writes_nothing_under_home(tmp_path):
    """The import and a build, in a process whose HOME is empty: nothing lands under ~/.cache."""
    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    code = (
        "import os, sys, json\n"
        "from kvledger.properties.subject import SubjectConfig\n"
        "from kvledger.subjects import sglang\n"
        "s = sglang.build(SubjectConfig(num_pages=4, page_size=2, max_seq_len=8))\n"
        "s.submit(1, [1, 2, 3], 2); s.admit(1, 8); s.allocate(1, 0, 3)\n"
        "print(json.dumps({'tv': [m for m in sys.modules if m.startswith('torchvision')],\n"
        "                  'env': {k: os.environ.get(k) for k in ('TORCHINDUCTOR_COMPILE_THREADS',\n"
        "                          'SGLANG_CACHE_DIR', 'TRITON_CACHE_DIR')}}))\n"
    )
    own = ("SGLANG_", "TVM_FFI_", "TRITON_", "TORCHINDUCTOR_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(own)}
    env.update(HOME=str(home), KVLEDGER_CACHE=str(cache), OMP_WAIT_POLICY="PASSIVE")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["tv"] == []  # the stand-ins were taken out again
    assert seen["env"]["TORCHINDUCTOR_COMPILE_THREADS"] is None  # put back as it was
    assert seen["env"]["SGLANG_CACHE_DIR"].startswith(str(cache))
    assert seen["env"]["TRITON_CACHE_DIR"].startswith(str(cache))  # sglang's own, under ours: kept
    assert not (home / ".cache").exists() and not (home / ".triton").exists()


# -- the protocol and the view ---------------------------------------------------------------------------------


def test_view_reads_rows_free_list_tree_and_counters():
    s = _build()
    s.submit(1, A, 3)
    assert s.admit(1, 6) == 0
    assert s.allocate(1, 0, 6)
    view = s.view()
    # pages come off the front of the free tensor: 1 and 2, position p at page * 4 + p % 4
    assert view.requests == {1: [4, 5, 6, 7, 8, 9]} and view.free == [3, 4, 5, 6, 7, 8]
    assert view.cached == []
    assert view.counters == {
        "free_pages": 6,
        "evictable_tokens": 0,
        "protected_tokens": 0,
        "cached_tokens": 0,
        "available_tokens": 24,
    }
    s.computed(1, 0, 6, None)  # a middle chunk: checkpointed at the top of the next step, not before
    assert _entries(s) == {} and s.chunk_to_stash == 1
    assert s.allocate(1, 6, 10)  # the next step: stash_chunked_request files its one full page, locked
    assert _entries(s) == {(1, 2, 3, 4): ((4, 5, 6, 7), 1)} and s.chunk_to_stash is None
    assert s.view().counters["protected_tokens"] == 4
    s.computed(1, 6, 10, 100)  # the rest of the prompt, then its sampled token
    assert _entries(s) == {(1, 2, 3, 4): ((4, 5, 6, 7), 1), (1, 2, 3, 4, 5, 6, 7, 8): ((8, 9, 10, 11), 1)}
    _run(s, 1, 10, 11, 101)
    _run(s, 1, 11, 12, 102)  # the third token: max_tokens reached
    s.finish(1)
    view = s.view()
    # release inserts what it holds in whole pages (prompt + two decoded tokens) and unlocks the path
    assert view.requests == {} and _entries(s)[tuple(A) + (100, 101)] == ((12, 13, 14, 15), 0)
    assert view.counters["evictable_tokens"] == 12 and view.counters["protected_tokens"] == 0
    assert sorted(view.free) == [4, 5, 6, 7, 8]


def test_hit_is_page_aligned_and_leaves_the_last_token():
    s = _build()
    s.submit(1, A[:8], 1)
    assert s.admit(1, 64) == 0
    _run(s, 1, 0, 8, 100)
    s.finish(1)
    s.submit(2, A[:8], 2)  # the same 8 tokens: cached whole, but the match stops a page short
    assert s.admit(2, 64) == 4
    assert s.view().requests[2] == [4, 5, 6, 7]  # admitted, not allocated: it holds its locked match
    s.submit(3, A[:6] + [50], 2)  # diverges inside the second page: one page
    assert s.admit(3, 64) == 4


def test_checkpoint_points_a_duplicate_row_at_the_trees_pages():
    """Two requests with one prompt in one batch compute it twice; the second checkpoint frees its
    duplicates and rewrites its row (what mini-sglang at 20fcd7f leaves undone)."""
    config = SubjectConfig(num_pages=16, page_size=4, max_seq_len=32)
    s = _build(config)
    for uid in (1, 2):
        s.submit(uid, A, 2)
        assert s.admit(uid, 32) == 0
        assert s.allocate(uid, 0, 10)
    own = s.view().requests[2]
    s.computed(1, 0, 10, 100)
    s.computed(2, 0, 10, 100)
    view = s.view()
    assert view.requests[2][:8] == view.requests[1][:8] != own[:8]
    assert view.requests[2][8:] == own[8:]  # its partial page stays its own
    assert {own[0] // 4, own[4] // 4} <= set(view.free)
    assert _entries(s)[tuple(A[:8])][1] == 2  # both hold the path


def test_refused_admission_changes_nothing():
    s = _build()
    s.submit(1, A, 4)
    assert s.admit(1, 64) == 0
    _run(s, 1, 0, 10, 100)
    s.submit(2, A[:4] + list(range(60, 74)), 4)
    before = s.view()
    # 14 to compute + 4 decode tokens + a page = 22 tokens wanted; 20 free, nothing evictable,
    # less uid 1's estimated 3 * 0.7 decode tokens: refused, its match (a split node) unlocked again
    assert s.admit(2, 64) is None
    assert s.view().free == before.free and s.view().requests == before.requests
    assert s.view().counters == before.counters
    assert sorted(loc for e in s.view().cached for loc in e.locations) == list(range(4, 12))


def test_decode_without_room_then_preempt_and_readmit(monkeypatch):
    # a fully decayed new_token_ratio (SGLANG_INIT_NEW_TOKEN_RATIO=0): admission counts no decode
    # tokens of running requests, so two requests that each need 4 of the 7 pages are admitted
    monkeypatch.setenv("SGLANG_INIT_NEW_TOKEN_RATIO", "0")
    s = _build(SubjectConfig(num_pages=7, page_size=4, max_seq_len=16))
    for uid, prompt in ((1, [1, 2, 3, 4]), (2, [5, 6, 7, 8])):
        s.submit(uid, prompt, 12)
        assert s.admit(uid, 64) == 0
        _run(s, uid, 0, 4, 10 * uid)
    n, refused, before = 5, False, None
    while not refused:
        assert s.allocate(1, n - 1, n)
        before = s.view()
        refused = not s.allocate(2, n - 1, n)
        s.computed(1, n - 1, n, 30 + n)
        if not refused:
            s.computed(2, n - 1, n, 50 + n)
            n += 1
    assert n == 13 and before.free == []  # position 12 needs a fourth page for uid 2: none left
    s.preempt(2)  # retract_decode -> release_req
    view = s.view()
    assert 2 not in view.requests
    # released without a checkpoint, then release_req evicted for the remaining request's next 20
    # decode tokens: its cached prompt page went too
    assert (5, 6, 7, 8) not in _entries(s) and len(view.free) == 3
    req = s.requests[2].req
    assert len(req.output_ids) == 9 and req.kv.req_pool_idx is None  # it keeps its output tokens
    for position in (13, 14):  # uid 1's last two tokens, in the page it has
        _run(s, 1, position, position + 1, 30 + position)
    s.finish(1)
    # admitted again with prompt + output as its prompt
    assert s.admit(2, 64) == 0 and len(req.full_untruncated_fill_ids) == 13
    assert s.allocate(2, 0, 13) and len(s.view().requests[2]) == 13


def test_abort_waiting_mid_prefill_and_running():
    s = _build()
    s.submit(1, A, 3)
    s.submit(2, [7, 7], 2)
    s.abort(2)  # never admitted: nothing to release
    assert s.admit(1, 6) == 0
    _run(s, 1, 0, 6, None)
    # mid-prefill, its chunk not yet stashed: process_pending_chunked_abort comes first at the top
    # of the next step, release_kv_cache(checkpoint=False) frees the chunk, nothing is cached
    s.abort(1)
    view = s.view()
    assert view.requests == {} and view.cached == [] and len(view.free) == 8
    s.submit(4, A, 3)
    assert s.admit(4, 5) == 0
    _run(s, 4, 0, 5, None)
    _run(s, 4, 5, 8, None)  # this step first stashed [0, 5): its full page [0, 4) is filed
    s.abort(4)  # [5, 8) was never stashed: freed; the page [0, 4) stays cached, unlocked
    view = s.view()
    assert view.requests == {} and all(e.lock == 0 for e in view.cached)
    assert view.counters["cached_tokens"] == 4 and len(view.free) == 7
    s.submit(3, A, 3)
    assert s.admit(3, 64) == 4
    _run(s, 3, 4, 10, 100)
    s.abort(3)  # running: leaves through the finish path, its prompt cached
    assert s.view().counters["cached_tokens"] == 8 and s.view().requests == {}


def test_evict_gives_pages_back():
    s = _build()
    s.submit(1, A, 1)
    assert s.admit(1, 6) == 0
    _run(s, 1, 0, 6, None)  # the chunk's checkpoint files [1..4]
    _run(s, 1, 6, 10, 100)  # max_tokens reached: released (and filed up to [1..8]) by finish
    s.finish(1)
    assert s.view().counters["evictable_tokens"] == 8 and len(s.view().cached) == 2
    assert s.evict(4) == 4  # the LRU leaf: the second page
    assert _entries(s) == {(1, 2, 3, 4): ((4, 5, 6, 7), 0)}
    assert sorted(s.view().free) == [2, 3, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("page_size", [1, 2])
def test_small_pages(page_size):
    config = SubjectConfig(num_pages=12, page_size=page_size, max_seq_len=16)
    finding, driver = drive(
        _build(config),
        config,
        [
            _submit(1, A[:6], 2),
            _prefill(4),
            _prefill(),
            _submit(2, A[:5] + [40], 2),
            _prefill(),
            {"op": "decode"},
        ],
    )
    assert finding is None, finding
    assert driver.ops == 6


# -- the zoo ---------------------------------------------------------------------------------------------------


def _submit(uid: int, tokens: List[int], max_tokens: int) -> dict:
    return {"op": "submit", "uid": uid, "tokens": tokens, "max_tokens": max_tokens}


def _prefill(budget: int = 64) -> dict:
    return {"op": "prefill", "budget": budget}


# A finishes with its prompt cached; B, the same 8 tokens, hits the first page and recomputes the second
FINISH_THEN_HIT = [_submit(1, A[:8], 1), _prefill(), _submit(2, A[:8], 2), _prefill(), {"op": "decode"}]
# zoo name -> (pool pages, the script, the invariant the judge must name on the mutant): sglang:radix's
RADIX_SCRIPTS: Dict[str, Tuple[int, List[dict], str]] = {
    # B's match splits A's locked 8-token node at 4
    "sglang-split-node-drops-lock": (
        8,
        [_submit(1, A, 4), _prefill(), _submit(2, A[:4] + [70, 71, 72], 2), _prefill()],
        "1-2-partition",
    ),
    "sglang-inc-lock-ref-leaf-only": (8, FINISH_THEN_HIT, "1-2-partition"),
    "sglang-dec-lock-ref-keeps-protected": (8, FINISH_THEN_HIT, "9-counters"),
    "sglang-evict-forgets-free": (8, [_submit(1, A, 1), _prefill(), {"op": "evict", "tokens": 8}], "1-2-partition"),
    # B hits A's first page while A runs; B's checkpoint frees that page
    "sglang-insert-frees-from-zero": (
        8,
        [_submit(1, A, 4), _prefill(), _submit(2, A[:8] + [50, 51], 4), _prefill()],
        "1-2-partition",
    ),
    # two requests compute one prompt in one batch: the second keeps reading its freed duplicates
    "sglang-checkpoint-keeps-duplicate-row": (16, [_submit(1, A, 2), _submit(2, A, 2), _prefill(32)], "1-2-partition"),
    "sglang-free-segment-every-token": (8, FINISH_THEN_HIT, "1-2-partition"),
    "sglang-release-frees-protected": (8, FINISH_THEN_HIT, "1-2-partition"),
    "sglang-release-keeps-lock": (8, FINISH_THEN_HIT, "5-quiescence"),
    "sglang-hit-covers-last-token": (8, FINISH_THEN_HIT, "8-request"),
}
# sglang's (the UnifiedRadixCache's FullComponent and the checkpoint into it)
UNIFIED_SCRIPTS: Dict[str, Tuple[int, List[dict], str]] = {
    "sglang-unified-split-drops-lock": RADIX_SCRIPTS["sglang-split-node-drops-lock"],
    "sglang-unified-lock-anchor-only": (8, FINISH_THEN_HIT, "1-2-partition"),
    "sglang-unified-unlock-counts-after-decrement": (8, FINISH_THEN_HIT, "9-counters"),
    "sglang-unified-evict-forgets-free": RADIX_SCRIPTS["sglang-evict-forgets-free"],
    "sglang-unified-checkpoint-keeps-duplicate-row": RADIX_SCRIPTS["sglang-checkpoint-keeps-duplicate-row"],
}
# a 12-token prompt in chunks of 5 and 4 (the first stashed at the second's step), aborted, then
# the same prompt again: it hits what the stash filed
B = list(range(1, 13))
CHUNK_ABORT = [_submit(1, B, 2), _prefill(5), _prefill(4), {"op": "abort", "uid": 1}, _submit(2, B, 2), _prefill()]
UNIFIED_SCRIPTS.update(
    {
        name: (8, CHUNK_ABORT, "1-2-partition")
        for name in (
            "sglang-chunk-stash-keeps-protected-len",
            "sglang-chunk-stash-keeps-old-lock",
            "sglang-chunk-stash-frees-matched-prefix",
            "sglang-chunk-stash-past-the-chunk",
            "sglang-chunk-abort-frees-from-zero",
        )
    }
)
SCRIPTS = {"sglang": UNIFIED_SCRIPTS, "sglang:radix": RADIX_SCRIPTS}
ENTRIES = [(spec, edit) for spec, zoo in sorted(sglang.ZOOS.items()) for edit in zoo]


@pytest.mark.parametrize("spec", sorted(SCRIPTS))
def test_zoo_is_complete_and_applies_to_the_installed_version(spec):
    names = [e.name for e in sglang.ZOOS[spec]]
    assert len(names) >= 5 and len(set(names)) == len(names)
    assert set(names) == set(SCRIPTS[spec])
    for edit in sglang.ZOOS[spec]:
        edited_function(edit)  # EditError unless the text occurs exactly once
    assert sglang.ZOO == sglang.ZOOS["sglang"]


@pytest.mark.parametrize("spec, edit", ENTRIES, ids=lambda e: getattr(e, "name", e))
def test_judge_catches_zoo_entry(spec, edit):
    pages, ops, kind = SCRIPTS[spec][edit.name]
    config = SubjectConfig(num_pages=pages, page_size=4, max_seq_len=32)
    finding, _ = drive(_build(config, [edit], spec), config, ops)
    assert finding is not None and finding.kind == kind, f"{edit.name}: {finding}"
    # the edit lives on that instance (or its adapter) alone: a fresh build runs the same script clean
    clean, driver = drive(_build(config, spec=spec), config, ops)
    assert clean is None, f"{edit.name}: the unedited subject fails the same script: {clean}"
    assert driver.ops == len(ops)


def test_a_paged_allocator_edit_does_not_run_at_page_size_1():
    """At page size 1 SGLang builds TokenToKVPoolAllocator: an edit of the paged allocator's code
    builds (the zoo's fuzz draws page size 1 too) and leaves that subject's allocator as it is; a
    text that is not there is still an EditError."""
    edit = next(e for e in sglang.ZOOS["sglang:radix"] if e.name == "sglang-free-segment-every-token")
    small = _build(SubjectConfig(num_pages=8, page_size=1, max_seq_len=16), [edit], "sglang:radix")
    assert "__kvledger_edits__" not in small.allocator.__dict__
    paged = _build(SubjectConfig(num_pages=8, page_size=4, max_seq_len=16), [edit], "sglang:radix")
    assert paged.allocator.free_segment.__func__.__kvledger_edit__ == edit.name
    missing = SourceEdit("x", edit.target, "nowhere", "", "")
    with pytest.raises(EditError, match="occurs 0 times"):
        _build(SubjectConfig(num_pages=8, page_size=1, max_seq_len=16), [missing])


def test_function_edits_stay_with_their_subject():
    edit = next(e for e in sglang.ZOOS["sglang:radix"] if e.name == "sglang-release-keeps-lock")
    mutant, clean = _build(edits=[edit]), _build()
    for s in (mutant, clean):
        s.submit(1, A[:8], 1)
        assert s.admit(1, 64) == 0
        _run(s, 1, 0, 8, 100)
        s.finish(1)
    assert [e.lock for e in mutant.view().cached] == [1] and [e.lock for e in clean.view().cached] == [0]
    assert sglang.load().common.release_kv_cache is clean.functions[f"{sglang.COMMON}:release_kv_cache"]


# -- seeded workloads: no finding on the unedited subject ------------------------------------------------------


def _cases(seeds: Sequence[int]) -> set:
    from kvledger.checker.subject_walk import run_case

    events: set = set()
    for seed in seeds:
        result = run_case(lambda config: sglang.build(config), seed)
        assert result.finding is None, f"seed {seed}: {result.finding}\n{result.finding.detail}"
        events |= set(result.events)
    return events


def test_seeded_cases_find_nothing():
    """The fuzzer's first cases (seeded shapes, page sizes 1, 2 and 4) on the unedited subject."""
    events = _cases(range(40))
    assert {
        "hit: prefix hit",
        "hit: diverges inside a cached page",
        "prefill: chunked",
        "admission: refused",
        "allocate: full pool with locked entries",
        "driver: idle after work",
    } <= events
    # SGLang's initial new_token_ratio (0.7) keeps these small pools from ever retracting
    assert "preempt: a running request preempted" not in events


def test_seeded_cases_that_retract_find_nothing(monkeypatch):
    """At SGLANG_INIT_NEW_TOKEN_RATIO=0.05 (a deployment's knob) these fuzzer cases run out of
    room in decode and retract requests, which are admitted again later."""
    monkeypatch.setenv("SGLANG_INIT_NEW_TOKEN_RATIO", "0.05")
    assert "preempt: a running request preempted" in _cases([159, 192, 228])
