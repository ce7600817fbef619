"""The judge's clauses for two managers that did not fit the protocol (issue 35, misfits 2 and 4):
a preempted request that keeps its pages until it is resumed or dropped (`preempt_keeps_pages`,
`View.preempted`, `Witness.preempted`), and a prefix cache that holds its own reference on each
cached page (`cache_holds_reference`). Before, both were findings of a sound subject (a leak, a
reference count off by one); now each is sound when declared, and each is still judged."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvledger.engine.ledger.invariants import InvariantViolation
from kvledger.properties.subject import CachedEntry, Capabilities, View
from kvledger.properties.subject_judge import Witness, judge

PS = 2
BASE = Capabilities(
    page_size=PS,
    pages=tuple(range(8)),
    worst_case_admission=False,
    preempts=True,
    explicit_evict=True,
    cached_pages_in_free_pool=False,
)
KEEPS = replace(BASE, preempt_keeps_pages=True)
OWN_REF = replace(BASE, cache_holds_reference=True)


def verdict(view: View, witness: Witness, caps: Capabilities):
    try:
        judge(view, caps, witness)
    except InvariantViolation as e:
        return e.invariant, str(e)
    return None


def state():
    """uid 1 live: read cached [5, 6] (page 0), computed [7, 8] (page 1), holds page 2 for its
    decode. uid 2 preempted, keeping pages 3-4 (positions 0-3 of [9, 9, 9, 9, 1])."""
    witness = Witness()
    witness.tokens[1], witness.prompt_len[1] = [5, 6, 7, 8, 3], 4
    witness.tokens[2], witness.prompt_len[2] = [9, 9, 9, 9, 1], 4
    witness.wrote([0, 1, 2, 3], [5, 6, 7, 8], 0)
    witness.wrote([6, 7, 8, 9], [9, 9, 9, 9], 0)
    witness.computed[1] = 4
    witness.preempted.add(2)
    view = View(
        free=[5, 6, 7],
        requests={1: [0, 1, 2, 3, 4]},
        cached=[CachedEntry((0, 1), 0, tokens=(5, 6), lock=1, name="node a")],
        page_refs={0: 1, 1: 1, 2: 1, 3: 1, 4: 1},
        preempted={2: [6, 7, 8, 9]},
    )
    return view, witness


def test_a_preempted_request_holding_its_pages_is_sound_when_declared():
    view, witness = state()
    assert verdict(view, witness, KEEPS) is None


def test_before_the_capability_it_was_a_leak_and_undeclared_it_is_a_finding():
    view, witness = state()
    found = verdict(view, witness, BASE)
    assert found[0] == "8-request" and "uids [2] as preempted and holding pages, but it does not declare" in found[1]
    view.preempted = {}  # what an adapter had to do: hide the pages, which then are owned by nobody
    view.page_refs = {0: 1, 1: 1, 2: 1}
    found = verdict(view, witness, BASE)
    assert found[0] == "1-2-partition" and "page 3 is owned by nobody" in found[1], found


def _share_page_5(cached: bool, at: int):
    """uid 1 now reads [9, 9] from page 5 (locations 10-11) at positions 0-1; preempted uid 2 holds
    page 5 at positions `at`, `at` + 1, its other page (4 or 3) beside it."""

    def change(view, witness):
        witness.tokens[1] = [9, 9, 7, 8, 3]
        witness.wrote([10, 11], [9, 9], 0)
        witness.wrote([2, 3], [9, 9, 7, 8], 2)
        view.requests[1] = [10, 11, 2, 3, 4]
        view.preempted[2], other = ([10, 11, 8, 9], 4) if at == 0 else ([6, 7, 10, 11], 3)
        view.free = sorted({0, 3, 4, 6, 7} - {other})
        view.cached = [CachedEntry((10, 11), 0, tokens=(9, 9), lock=2, name="node b")] if cached else []
        view.page_refs = {5: 2, 1: 1, 2: 1, other: 1}

    return change


@pytest.mark.parametrize(
    "change, invariant, words",
    [
        (lambda v, w: v.free.append(3), "1-2-partition", "page 3 is free, but preempted uid(s) [2] hold it"),
        (
            lambda v, w: v.preempted.__setitem__(2, [6, 7, 2, 3]),
            "1-2-partition",
            "page 1 is held by uids [1, 2] but not cached",
        ),
        (lambda v, w: w.preempted.clear(), "8-request", "uids [2] hold pages as preempted requests, but the driver"),
        (lambda v, w: v.page_refs.__setitem__(4, 0), "1-2-partition", "page 4 has reference count 0, but 1 request(s)"),
        (
            lambda v, w: v.preempted.__setitem__(2, [6, 8, 7, 9]),
            "1-2-partition",
            "preempted uid 2: position 1 is at location 8, not offset 1 of the page that holds position 0 (location 6)",
        ),
        (
            lambda v, w: (v.preempted[2].extend([10, 11, 12]), v.free.remove(5), v.free.remove(6)),
            "11-over-allocation",
            "uid 2 holds locations for 7 positions in group 0, but it has 5 tokens and may hold at most 6",
        ),
        (_share_page_5(False, 0), "1-2-partition", "page 5 is held by uids [1, 2] but not cached"),
        (_share_page_5(True, 2), "1-2-partition", "page 5 is held by uids [1, 2] at different positions"),
    ],
)
def test_each_preempted_clause_names_what_broke(change, invariant, words):
    view, witness = state()
    change(view, witness)
    found = verdict(view, witness, KEEPS)
    assert found is not None and found[0] == invariant and words in found[1], found


def test_a_preempted_request_shares_cached_pages_at_the_same_positions():
    view, witness = state()
    _share_page_5(True, 0)(view, witness)
    assert verdict(view, witness, KEEPS) is None
    view.cached[0] = replace(view.cached[0], lock=1)
    found = verdict(view, witness, KEEPS)
    assert "node b (positions [0, 2)) has lock count 1, but 2 request(s) (live uid(s) [1] and preempted" in found[1]


def test_quiescence_waits_for_preempted_holders():
    view, witness = state()
    witness.computed.clear()
    view.requests = {}
    view.cached = []
    view.free = [0, 1, 2, 5, 6, 7]
    view.page_refs = {3: 1, 4: 1}
    assert verdict(view, witness, KEEPS) is None  # uid 2 still holds pages 3-4: not quiescent
    view.preempted = {}
    view.free = list(range(8))
    witness.preempted.clear()
    found = verdict(view, witness, KEEPS)
    assert found[0] == "5-quiescence" and "pages [3, 4] have reference counts [1, 1]" in found[1]
    view.page_refs = {}
    assert verdict(view, witness, KEEPS) is None


def own_ref_state():
    """uid 1 holds cached page 0 (one reference of its own, one of the cache's) and page 1; page 2
    is cached and held by nobody (the cache's reference only); 3-7 free."""
    witness = Witness()
    witness.tokens[1], witness.prompt_len[1] = [5, 6, 7, 8, 3], 4
    witness.wrote([0, 1, 2, 3], [5, 6, 7, 8], 0)
    witness.wrote([4, 5], [4, 4], 0)
    witness.computed[1] = 4
    view = View(
        free=[3, 4, 5, 6, 7],
        requests={1: [0, 1, 2, 3]},
        cached=[
            CachedEntry((0, 1), 0, tokens=(5, 6), lock=2, name="block 0"),
            CachedEntry((4, 5), 0, tokens=(4, 4), lock=1, name="block 2"),
        ],
        page_refs={0: 2, 1: 1, 2: 1},
        counters={"evictable_tokens": 2, "protected_tokens": 2},
    )
    return view, witness


def test_a_cache_holding_its_own_reference_is_sound_when_declared_and_a_finding_otherwise():
    view, witness = own_ref_state()
    assert verdict(view, witness, OWN_REF) is None
    found = verdict(view, witness, BASE)  # misfit 4, before: one reference too many on every cached page
    assert found == (
        "1-2-partition",
        "[1-2-partition] page 0 has reference count 2, but 1 live request(s) [1] hold it",
    ), found


@pytest.mark.parametrize(
    "change, words",
    [
        (
            lambda v: v.page_refs.__setitem__(0, 1),
            "page 0 has reference count 1, but 1 live request(s) [1] hold it plus",
        ),
        (
            lambda v: v.page_refs.__setitem__(2, 0),
            "page 2 has reference count 0, but 0 live request(s) [] hold it plus",
        ),
        (lambda v: v.page_refs.__setitem__(1, 2), "page 1 has reference count 2, but 1 live request(s) [1] hold it"),
        (
            lambda v: v.cached.__setitem__(0, replace(v.cached[0], lock=1)),
            "block 0 (positions [0, 2)) has lock count 1",
        ),
        (lambda v: v.counters.__setitem__("evictable_tokens", 0), "evictable_tokens = 0, its structures hold 2"),
    ],
)
def test_the_caches_own_reference_is_counted_exactly_once(change, words):
    view, witness = own_ref_state()
    change(view)
    found = verdict(view, witness, OWN_REF)
    assert found is not None and words in found[1], found


def test_quiescence_with_the_caches_own_reference():
    view, witness = own_ref_state()
    witness.computed.clear()
    view.requests = {}
    view.free = [1, 3, 4, 5, 6, 7]
    view.cached = [replace(e, lock=1) for e in view.cached]
    view.page_refs = {0: 1, 1: 0, 2: 1}
    view.counters = {}
    assert verdict(view, witness, OWN_REF) is None
    assert verdict(view, witness, BASE)[0] == "5-quiescence"
    view.page_refs[1] = 1  # not cached: no reference of the cache's own
    found = verdict(view, witness, OWN_REF)
    assert found[0] == "5-quiescence" and "pages [1] have reference counts [1] (the cache's own" in found[1]
    view.page_refs[1] = 0
    view.cached[1] = replace(view.cached[1], lock=2)
    assert verdict(view, witness, OWN_REF)[0] == "5-quiescence"
