"""A prefill whose `stop` names a request that samples no token in it is refused (InvalidOp) and
changes nothing, on both implementations: the lockstep harness and replay drop a refused operation
from the trace, so a refusal that left admission's work behind (a lock, a table slot, a split node,
LRU stamps) desynchronised the two sides. A stop on an empty step is refused too."""

import pytest

from kvledger.engine.ledger import trace
from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.engine.ledger.invariants import tolist
from kvledger.engine.ledger.ops import InvalidOp
from kvledger.properties.lockstep import Lockstep, replay
from kvledger.properties.machine import EvictionOrderWatch

HEADER = trace.Header(num_pages=12, page_size=1, cache_type="radix", table_slots=4, max_seq_len=64)
# uid 0 leaves [1, 2, 3, 4, 5, 6] cached; uid 1 runs, holding pages; uids 2 and 3 wait. uid 2's
# match splits the cached node at [1, 2]; with budget 3 it is left mid-chunk, with budget 4 it is
# admitted whole; either way uid 3 gets nothing.
SETUP = [
    {"op": "submit", "uid": 0, "tokens": [1, 2, 3, 4, 5, 6], "max_tokens": 1},
    {"op": "prefill", "budget": 64, "sample": [0]},
    {"op": "submit", "uid": 1, "tokens": [7, 7], "max_tokens": 3},
    {"op": "prefill", "budget": 64, "sample": [0]},
    {"op": "submit", "uid": 2, "tokens": [1, 2, 8, 8, 8, 8], "max_tokens": 1},
    {"op": "submit", "uid": 3, "tokens": [9], "max_tokens": 1},
]
AFTER = [
    {"op": "prefill", "budget": 4, "sample": [0]},
    {"op": "decode", "sample": [0]},
    {"op": "prefill", "budget": 64, "sample": [0], "stop": [3]},
    {"op": "evict", "tokens": 2},
    {"op": "submit", "uid": 4, "tokens": [1, 2, 3, 9], "max_tokens": 2},
    {"op": "prefill", "budget": 64, "sample": [0]},
    {"op": "decode", "sample": [0]},
]


def _state(sched: CacheScheduler):
    """The snapshot the lockstep compares, plus what it leaves out: the tree and its LRU clock."""
    cache = sched.cm.prefix_cache
    tree = [(n.id, list(n.key), tolist(n.value), n.ref_count, n.last_access) for n in cache.nodes()]
    return sched.snapshot(), tree, cache.clock, sorted(sched.live), dict(sched._preempted)


def _lockstep(ops=SETUP):
    lock = Lockstep(HEADER)
    for op in ops:
        lock.apply(op)
    return lock


@pytest.mark.parametrize(
    "op",
    [
        {"op": "prefill", "budget": 3, "sample": [0], "stop": [3]},  # uid 2 takes the whole budget
        {"op": "prefill", "budget": 4, "sample": [0], "stop": [3]},
        {"op": "prefill", "budget": 3, "sample": [0], "stop": [2]},  # uid 2 is left mid-chunk
        {"op": "prefill", "budget": 64, "sample": [0], "stop": [2, 3, 1]},  # uid 1 runs: known up front
        {"op": "prefill", "budget": 64, "sample": [0], "stop": [2, 2]},
    ],
)
@pytest.mark.parametrize("side", ["ref", "fast"])
def test_a_refused_prefill_leaves_the_scheduler_as_it_was(side, op):
    lock = _lockstep()
    sched = getattr(lock, side)
    held = (sched.cm, sched.cm.prefix_cache, sched.tm, sched.dm, sched.page_table, sched.waiting)
    before = _state(sched)
    with pytest.raises(InvalidOp, match="stop names"):
        sched.apply(dict(op))
    assert _state(sched) == before
    # whoever held a part of the scheduler still holds the live one
    assert all(
        a is b
        for a, b in zip(held, (sched.cm, sched.cm.prefix_cache, sched.tm, sched.dm, sched.page_table, sched.waiting))
    )


def test_both_sides_agree_after_a_refused_prefill_and_the_trace_replays():
    lock = _lockstep()
    with pytest.raises(InvalidOp):
        lock.apply({"op": "prefill", "budget": 4, "sample": [0], "stop": [3]})
    for op in AFTER:  # Lockstep.apply compares the two sides after each
        lock.apply(op)
    assert _state(lock.ref)[1:] == _state(lock.fast)[1:]
    replayed = replay(HEADER, lock.ops)
    assert _state(replayed.ref) == _state(lock.ref) and _state(replayed.fast) == _state(lock.fast)


def test_a_request_turned_away_by_a_small_pool_cannot_stop():
    # a pool too small for uid 2: it is turned away (its match split a node and stamped its path)
    lock = Lockstep(trace.Header(num_pages=9, page_size=1, cache_type="radix", table_slots=4, max_seq_len=64))
    for op in SETUP[:5]:
        lock.apply(op)
    for sched in (lock.ref, lock.fast):
        before = _state(sched)
        with pytest.raises(InvalidOp, match="sampled no token"):
            sched.apply({"op": "prefill", "budget": 64, "sample": [0], "stop": [2]})
        assert _state(sched) == before
    assert lock.apply({"op": "prefill", "budget": 64, "sample": [0]}).refused == 2


def test_the_eviction_order_watch_keeps_watching_the_restored_cache():
    lock = _lockstep()
    notes = []
    watch = EvictionOrderWatch(lock.ref.cm.prefix_cache, note=notes.append)
    with pytest.raises(InvalidOp):
        lock.apply({"op": "prefill", "budget": 3, "sample": [0], "stop": [3]})
    assert watch.cache is lock.ref.cm.prefix_cache
    assert lock.ref.cm.prefix_cache.evict.__name__ == "watched_evict"


@pytest.mark.parametrize("side", ["ref", "fast"])
def test_a_stop_on_an_empty_step_is_refused(side):
    lock = Lockstep(HEADER)
    sched = getattr(lock, side)
    with pytest.raises(InvalidOp, match="not running"):
        sched.apply({"op": "decode", "sample": [], "stop": [0]})
    with pytest.raises(InvalidOp, match="not waiting"):
        sched.apply({"op": "prefill", "budget": 8, "sample": [], "stop": [0]})
    sched.apply({"op": "submit", "uid": 0, "tokens": [1, 2, 3], "max_tokens": 2})
    sched.apply({"op": "submit", "uid": 1, "tokens": [4], "max_tokens": 2})
    sched.apply({"op": "prefill", "budget": 3, "sample": [0]})
    # uid 1 waits; a decode may name only running requests, and each once
    with pytest.raises(InvalidOp, match="not running"):
        sched.apply({"op": "decode", "sample": [], "stop": [1]})
    with pytest.raises(InvalidOp, match="twice"):
        sched.apply({"op": "decode", "sample": [], "stop": [0, 0]})
    assert sched.apply({"op": "decode", "sample": [], "stop": [0]}).batch == (0,)
    assert not sched.live and [p.uid for p in sched.waiting] == [1]
