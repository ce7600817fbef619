"""The eviction-ordering events of the property run (`EvictionOrderWatch` and the radix cache's
notes), on scripted operations: each names exactly the state a heap bookkeeping bug needs, and the
zoo bug of that state diverges there."""

import pytest

from kvledger.engine.ledger.trace import Header
from kvledger.properties.eviction_order_watch import EvictionOrderWatch
from kvledger.properties.lockstep import Finding, Lockstep
from kvledger.reference import events
from kvledger.subjects.fast_zoo import patched

RETOUCHED = "radix: eviction after a cached leaf was re-touched"
GAINED = "radix: eviction after a leaf gained a child"
LOCK = "radix: lock/unlock of an evictable leaf"


def run(ops, bug=None):
    """Apply `ops` in lockstep (radix, one-token pages, no pressure); the events noted, in order:
    the watch's, and the reference's own."""
    lock = Lockstep(Header(num_pages=32, page_size=1, cache_type="radix", table_slots=4, max_seq_len=16))
    seen = []
    EvictionOrderWatch(lock.ref.cm.prefix_cache, seen.append)
    events.set_listener(seen.append)
    try:
        with patched(bug):
            for op in ops:
                lock.apply(op)
    finally:
        events.set_listener(None)
    return seen


def ordering(ops, bug=None):
    return [e for e in run(ops, bug) if e in (RETOUCHED, GAINED)]


def one_token(uid, tokens):
    """A request that ends at its prefill (one output token): its prompt is cached, unlocked."""
    return [
        {"op": "submit", "uid": uid, "tokens": tokens, "max_tokens": 1},
        {"op": "prefill", "budget": 64, "sample": [0]},
    ]


# [1] is cached, then [2]; a request for [1] matches nothing (the last prompt token is never
# matched), so its insert at finish stamps the cached leaf [1] again, with no lock around it.
RETOUCH = one_token(0, [1]) + one_token(1, [2]) + one_token(2, [1])
EVICT_ONE = {"op": "evict", "tokens": 1}


def test_a_leaf_stamped_by_an_insert_then_an_eviction():
    assert ordering(RETOUCH + [EVICT_ONE]) == [RETOUCHED]
    with pytest.raises(Finding, match="result:evict"):
        run(RETOUCH + [EVICT_ONE], bug="touch-keeps-heap-entry")


def test_a_leaf_stamped_by_a_probe_is_re_keyed_by_its_unlock():
    """A probe locks and unlocks what it matched: fast re-enters the leaf with its new stamp."""
    ops = one_token(0, [1]) + one_token(1, [2]) + [{"op": "probe", "tokens": [1]}, EVICT_ONE]
    seen = run(ops)
    assert RETOUCHED not in seen and LOCK in seen
    run(ops, bug="touch-keeps-heap-entry")  # nothing for the bug to get wrong


def test_no_event_when_the_new_stamp_changes_no_order():
    """Stamped again, but no leaf was cached in between: the old and the new stamp order alike."""
    assert ordering(one_token(0, [1]) + one_token(1, [1]) + [EVICT_ONE]) == []


# Both in one batch: [3] ends first and unlocks its leaf, then [3, 3]'s insert extends it.
GAIN = [
    {"op": "submit", "uid": 0, "tokens": [3], "max_tokens": 1},
    {"op": "submit", "uid": 1, "tokens": [3, 3], "max_tokens": 1},
    {"op": "prefill", "budget": 64, "sample": [0]},
]


def test_a_leaf_that_gained_a_child_then_an_eviction():
    assert ordering(GAIN + [EVICT_ONE]) == [GAINED]
    with pytest.raises(Finding, match="invariant:1-2-partition"):
        run(GAIN, bug="insert-keeps-parent-heap-entry")


def test_a_gained_child_that_was_matched_since_is_no_longer_noted():
    """A later walk through the node re-keys it (its stale heap entry is gone)."""
    assert ordering(GAIN + [{"op": "probe", "tokens": [3, 3]}, EVICT_ONE]) == []
