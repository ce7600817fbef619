"""The subject-independent judge (properties/subject_judge.py), clause by clause.

Each test breaks one thing in an otherwise sound view and checks the judge names it. The judge-mode
driver around it is tests/properties/test_subject_driver.py's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvledger.engine.ledger.invariants import InvariantViolation, check_queue_order
from kvledger.properties.subject import CachedEntry, Capabilities, View
from kvledger.properties.subject_judge import Witness, judge

RADIX = Capabilities(
    page_size=2,
    pages=tuple(range(6)),
    worst_case_admission=True,
    preempts=False,
    explicit_evict=True,
    cached_pages_in_free_pool=False,
)
BLOCKS = replace(RADIX, worst_case_admission=False, preempts=True, cached_pages_in_free_pool=True)


def sound():
    """uid 1 read [5, 6, 7] (cached as pages 0-1, locked) and wrote [8]; page 2 is its own; 3-5 free."""
    witness = Witness()
    witness.tokens[1] = [5, 6, 7, 8, 9]
    witness.prompt_len[1] = 4
    witness.computed[1] = 4
    witness.wrote([0, 1, 2, 3], [5, 6, 7, 8], 0)
    view = View(
        free=[3, 4, 5],
        requests={1: [0, 1, 2, 3, 4]},
        cached=[CachedEntry((0, 1, 2, 3), 0, tokens=(5, 6, 7, 8), lock=1, name="node 1")],
        counters={"free_pages": 3, "evictable_tokens": 0, "protected_tokens": 4},
    )
    return view, witness


def verdict(view, witness, caps=RADIX, subject=None):
    try:
        judge(view, caps, witness, subject)
    except InvariantViolation as e:
        return e.invariant, str(e)
    return None


def test_a_sound_view_passes():
    assert verdict(*sound()) is None


@pytest.mark.parametrize(
    "change, invariant, words",
    [
        (lambda v, led: v.free.remove(5), "1-2-partition", "page 5 is owned by nobody"),
        (lambda v, led: v.free.append(4), "1-2-partition", "page 4 is in the free list twice"),
        (lambda v, led: v.free.append(2), "1-2-partition", "page 2 is free, but live uid(s) [1] hold it"),
        (lambda v, led: v.free.append(0), "1-2-partition", "page 0 is free, but live uid(s) [1]"),
        (lambda v, led: v.free.append(9), "1-2-partition", "holds 9, not a page of the pool"),
        (lambda v, led: v.requests.__setitem__(1, [0, 1, 2, 5, 4]), "1-2-partition", "position 3 is at location 5"),
        (lambda v, led: v.cached.__setitem__(0, replace(v.cached[0], lock=2)), "1-2-partition", "lock count 2"),
        (lambda v, led: v.counters.__setitem__("free_pages", 4), "9-counters", "free_pages = 4"),
        (lambda v, led: v.counters.__setitem__("protected_tokens", 2), "9-counters", "protected_tokens = 2"),
        (
            lambda v, led: led.written.__setitem__(2, led.written[3]),
            "7-kv-provenance",
            "uid 1: position 2 reads location 2",
        ),
        (lambda v, led: led.written.pop(1), "7-kv-provenance", "was never computed"),
        (lambda v, led: led.computed.__setitem__(2, 0), "8-request", "live uids [2] are missing"),
        (lambda v, led: led.computed.__setitem__(1, 6), "8-request", "computed 6 positions but holds locations for 5"),
    ],
)
def test_each_clause_names_what_broke(change, invariant, words):
    view, witness = sound()
    change(view, witness)
    found = verdict(view, witness)
    assert found is not None and found[0] == invariant and words in found[1], found


def test_a_cached_entry_must_hold_kv_of_the_tokens_it_claims():
    view, witness = sound()
    view.cached[0] = replace(view.cached[0], tokens=(5, 6, 7, 0))
    assert verdict(view, witness)[0] == "7-kv-provenance"


def test_pages_two_requests_share_must_be_cached_at_the_same_positions():
    view, witness = sound()
    witness.tokens[2], witness.prompt_len[2], witness.computed[2] = [5, 6, 7, 8, 1], 5, 2
    view.requests[2] = [0, 1, 10, 11]  # shares page 0 (positions 0-1) with uid 1, owns page 5
    view.free, view.counters = [3, 4], {}
    view.cached = [
        CachedEntry((0, 1), 0, tokens=(5, 6), lock=1, name="node 1"),
        CachedEntry((2, 3), 2, tokens=(5, 6, 7, 8), lock=1, name="node 2"),
    ]
    assert "node 1 (positions [0, 2)) has lock count 1, but 2" in verdict(view, witness)[1]
    view.cached[0] = replace(view.cached[0], lock=2)
    assert verdict(view, witness) is None
    view.cached = []
    view.free = [3, 4, 1]
    found = verdict(view, witness)
    assert found[0] == "1-2-partition" and "page 0 is held by uids [1, 2] but not cached" in found[1]
    view.requests[2] = [10, 11, 0, 1]
    view.cached = [CachedEntry((0, 1), 0, tokens=(5, 6), lock=1), CachedEntry((2, 3), 2, tokens=(5, 6, 7, 8), lock=1)]
    view.free = [3, 4]
    found = verdict(view, witness)
    assert "held by uids [1, 2] at different positions [0, 2]" in found[1] or "lock count" in found[1], found


def test_quiescence_no_lock_without_a_live_request():
    view, witness = sound()
    witness.computed.clear()
    view.requests.clear()
    view.free = [2, 3, 4, 5]
    view.counters = {"free_pages": 4}
    assert verdict(view, witness)[0] == "5-quiescence"
    view.cached[0] = replace(view.cached[0], lock=0)
    assert verdict(view, witness) is None


def test_a_hash_chained_key_is_recomputed_with_the_subjects_own_function():
    class Keys:
        def cache_key(self, tokens):
            return ("key", tuple(tokens))

    view, witness = sound()
    view.cached = [
        CachedEntry((0, 1), None, key=("key", (5, 6)), name="block 0"),
        CachedEntry((2, 3), None, key=("key", (5, 6, 7, 8)), name="block 1"),
    ]
    view.page_refs = {p: (1 if p < 3 else 0) for p in range(6)}
    view.counters = {"free_pages": 3}
    assert verdict(view, witness, BLOCKS, Keys()) is None
    view.cached[1] = replace(view.cached[1], key=("key", (7, 8)))  # chained from the wrong parent
    found = verdict(view, witness, BLOCKS, Keys())
    assert found[0] == "7-kv-provenance" and "a hit there reads KV of another prefix" in found[1]
    view.page_refs[0] = 2
    assert "reference count 2" in verdict(view, witness, BLOCKS, Keys())[1]


def test_queue_order_first_come_first_served_and_preempted_ahead():
    arrival = {1: 0, 2: 1, 3: 2}
    check_queue_order([1, 2, 3], arrival, {}, set())
    with pytest.raises(InvariantViolation, match="not in arrival order"):
        check_queue_order([2, 1], arrival, {}, set())
    check_queue_order([3, 1, 2], arrival, {3: 0}, {3})
    with pytest.raises(InvariantViolation, match="waits behind uid 1, which was never admitted"):
        check_queue_order([1, 3, 2], arrival, {3: 0}, {3})
