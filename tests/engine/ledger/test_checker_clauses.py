"""A test for every checker clause (issue 15): weakening any clause of a checker fails a test here.

Each test builds a valid state with real operations, asserts the checker accepts it, plants exactly
one violation by a direct state edit, and asserts the clause meant to catch it reports it (by the
clause's own message text). Checkers: CacheManager.check_integrity and
RadixPrefixCache.check_integrity (reference and fast; the naive caches' check_integrity has no
clause), CacheScheduler.check (the invariants after every operation: the judge of
engine/ledger/invariants.py, then the implementation's own check), and the lockstep comparison
(`divergence.compare`): each side's invariants, then every field of CacheScheduler.snapshot(); a
field added to the snapshot without a planting case here fails `test_every_snapshot_field_has_a_case`.

The state every test starts from (page size 2, 16 pages, radix cache, reserve admission), the same
on both implementations:

    cache:  node 1 [1,2,3,4] -> locations 0-3,   lock count 2 (uids 0 and 1)
            node 2 [9,9] under node 1 -> 10, 11,  lock count 1 (uid 1)
            node 3 [7,7,7,7] -> 14-17,            lock count 0 (uid 2 finished): an evictable leaf
    uid 0:  table slot 0, row [0 1 2 3 | 4 5 20 21],        owns pages at 4 and 20
    uid 1:  table slot 1, row [0 1 2 3 10 11 | 12 13 22 23], owns pages at 12 and 22
    free:   [24, 26, 28, 30, 6, 8, 18]; waiting: uids 3 and 4; table slots 3, 2 free
"""

import dataclasses
import heapq

import pytest
import torch

from kvledger import fast, reference
from kvledger.engine.ledger.cache_scheduler import CacheScheduler, InvariantViolation
from kvledger.engine.ledger.divergence import compare
from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.trace import Header
from kvledger.properties.lockstep import Lockstep

PS = 2
BASE = Header(num_pages=16, page_size=PS, cache_type="radix", table_slots=4, max_seq_len=32)
BASE_OPS = [
    {"op": "submit", "uid": 0, "tokens": [1, 2, 3, 4, 5], "max_tokens": 8},
    {"op": "submit", "uid": 1, "tokens": [1, 2, 3, 4, 9, 9, 9], "max_tokens": 8},
    {"op": "submit", "uid": 2, "tokens": [7, 7, 7, 7, 7], "max_tokens": 1},
    {"op": "prefill", "budget": 100, "sample": [3]},
    {"op": "decode", "sample": [3]},
    {"op": "decode", "sample": [3]},
    {"op": "decode", "sample": [3]},
    {"op": "submit", "uid": 3, "tokens": [8, 8, 8], "max_tokens": 2},
    {"op": "submit", "uid": 4, "tokens": [6, 6], "max_tokens": 2},
]
# optimistic admission on a 6-page pool: uid 1 is preempted by the fourth decode and waits again
PREEMPTED = Header(
    num_pages=6,
    page_size=PS,
    cache_type="radix",
    table_slots=4,
    max_seq_len=16,
    admission="optimistic",
    reserve_ratio=0.25,
)
PREEMPTED_OPS = [
    {"op": "submit", "uid": 0, "tokens": [1, 2, 3], "max_tokens": 8},
    {"op": "submit", "uid": 1, "tokens": [4, 5, 6], "max_tokens": 8},
    {"op": "prefill", "budget": 64, "sample": [1]},
] + [{"op": "decode", "sample": [1]}] * 4
SCENARIOS = {"base": (BASE, BASE_OPS), "preempted": (PREEMPTED, PREEMPTED_OPS)}


# -- building and editing states ------------------------------------------------------------------
def _driver(impl, scenario="base"):
    header, ops = SCENARIOS[scenario]
    d = CacheScheduler(impl, **header.cache_scheduler_args())
    for op in ops:
        d.apply(op)
    d.check()
    return d


def _ints(d, values):
    """Locations as the implementation holds them: a list (reference) or an int32 tensor (fast)."""
    values = [int(v) for v in values]
    return values if d.impl is reference else torch.tensor(values, dtype=torch.int32)


def _free(d):
    return [int(x) for x in d.cm.free_slots]


def _set_free(d, locs):
    d.cm.free_slots = _ints(d, locs)


def _write_row(d, uid, start, locs):
    d.page_table[d.live[uid].table_idx][start : start + len(locs)] = _ints(d, locs)


def _node(d, key):
    return next(n for n in d.cm.prefix_cache.nodes() if list(n.key) == key)


def _live(d):
    return list(d.live.values())


def test_the_starting_state_is_the_one_described(impl):
    d = _driver(impl)
    snap = d.snapshot()
    assert snap["rows"] == {0: [0, 1, 2, 3, 4, 5, 20, 21], 1: [0, 1, 2, 3, 10, 11, 12, 13, 22, 23]}
    assert snap["free_slots"] == [24, 26, 28, 30, 6, 8, 18]
    assert [
        (n.id, list(n.key), [int(v) for v in n.value], n.ref_count, n.parent.id) for n in d.cm.prefix_cache.nodes()
    ] == [(1, [1, 2, 3, 4], [0, 1, 2, 3], 2, 0), (2, [9, 9], [10, 11], 1, 1), (3, [7, 7, 7, 7], [14, 15, 16, 17], 0, 0)]
    assert [(r.uid, r.cache_handle.cached_len) for r in _live(d)] == [(0, 4), (1, 6)]


# -- CacheManager.check_integrity -----------------------------------------------------------------
def _plant_misaligned_cached(d):
    node = _node(d, [7, 7, 7, 7])
    node.value = _ints(d, [15, 16, 17, 18])


def _lock_count(delta):
    def plant(d):
        _node(d, [1, 2, 3, 4]).ref_count += delta

    return plant


def _radix_recount(d):
    d.cm.prefix_cache.evictable_size += PS


# name -> (plant, the reference's message, fast's message). Fast has no free-list-duplicate clause
# of its own: its owner count reports the page twice.
MANAGER_CASES = {
    "radix check is run": (_radix_recount, r"radix sizes recount", r"radix sizes recount"),
    "free list duplicate": (
        lambda d: _set_free(d, _free(d) + _free(d)[:1]),
        r"^integrity: a page is in the free list twice$",
        r"1 pages without exactly one owner, e\.g\. page 12 \(location 24\) has 2 owners",
    ),
    "misaligned free location": (
        lambda d: _set_free(d, [25] + _free(d)[1:]),
        r"\('free',\) holds location 25, not a page start in the pool",
        r"a free, cached or owned page start is misaligned or outside the pool",
    ),
    "misaligned cached location": (
        _plant_misaligned_cached,
        r"\('cache', 0\) holds location 15, not a page start in the pool",
        r"a free, cached or owned page start is misaligned or outside the pool",
    ),
    "misaligned owned location": (
        lambda d: _write_row(d, 0, 6, [21, 22]),
        r"\('req', 0\) holds location 21, not a page start in the pool",
        r"a free, cached or owned page start is misaligned or outside the pool",
    ),
    "location past the pool": (
        lambda d: _set_free(d, [16 * PS] + _free(d)[1:]),
        r"\('free',\) holds location 32, not a page start in the pool",
        r"a free, cached or owned page start is misaligned or outside the pool",
    ),
    "negative location": (
        lambda d: _set_free(d, [-PS] + _free(d)[1:]),
        r"\('free',\) holds location -2, not a page start in the pool",
        r"a free, cached or owned page start is misaligned or outside the pool",
    ),
    "page with no owner": (
        lambda d: _set_free(d, _free(d)[1:]),
        r"1 pages without exactly one owner, e\.g\. page 12 \(location 24\) owned by nobody",
        r"1 pages without exactly one owner, e\.g\. page 12 \(location 24\) has 0 owners",
    ),
    "page free and owned": (
        lambda d: _set_free(d, _free(d) + [20]),
        r"1 pages without exactly one owner, e\.g\. page 10 \(location 20\) "
        r"owned by \[\('free',\), \('req', 0\)\]",
        r"1 pages without exactly one owner, e\.g\. page 10 \(location 20\) has 2 owners",
    ),
    "page cached and owned": (  # uid 0's second page points at the cached leaf's: page 10 is lost
        lambda d: _write_row(d, 0, 6, [14, 15]),
        r"2 pages without exactly one owner, e\.g\. page 7 \(location 14\) "
        r"owned by \[\('cache', 0\), \('req', 0\)\]",
        r"2 pages without exactly one owner, e\.g\. page 7 \(location 14\) has 2 owners",
    ),
    "row not matching its locked prefix": (
        lambda d: _write_row(d, 1, 0, [6, 7]),
        r"request 1's row does not match its locked prefix",
        r"request 1's row does not match its locked prefix",
    ),
    "row not page-contiguous": (
        lambda d: _write_row(d, 0, 7, [23]),
        r"request 0's row is not page-contiguous at 7",
        r"request 0's row is not page-contiguous",
    ),
    "lock count above its holders": (
        _lock_count(+1),
        r"radix node 1 has lock count 3, but 2 live requests hold it",
        r"radix node 1 has lock count 3, but 2 live requests hold it",
    ),
    "lock count below its holders": (
        _lock_count(-1),
        r"radix node 1 has lock count 1, but 2 live requests hold it",
        r"radix node 1 has lock count 1, but 2 live requests hold it",
    ),
}


@pytest.mark.parametrize("case", MANAGER_CASES)
def test_cache_manager_clause(impl, case):
    plant, ref_message, fast_message = MANAGER_CASES[case]
    d = _driver(impl)
    d.cm.check_integrity(_live(d))
    plant(d)
    with pytest.raises(RuntimeError, match=ref_message if impl is reference else fast_message):
        d.cm.check_integrity(_live(d))


@pytest.mark.parametrize("where", ["free", "cached", "owned"])
def test_page_owners_refuses_a_location_outside_the_pages(impl, where):
    """page_owners' own clause (the snapshot's owners): fast's check_integrity counts pages
    without it, so only a direct call reaches it there."""
    d = _driver(impl)
    plant, loc, who = {
        "free": (MANAGER_CASES["location past the pool"][0], 32, r"\('free',\)"),
        "cached": (_plant_misaligned_cached, 15, r"\('cache', 0\)"),
        "owned": (MANAGER_CASES["misaligned owned location"][0], 21, r"\('req', 0\)"),
    }[where]
    plant(d)
    with pytest.raises(RuntimeError, match=rf"^integrity: {who} holds location {loc}, not a page start in the pool$"):
        d.cm.page_owners(_live(d))


# -- RadixPrefixCache.check_integrity -------------------------------------------------------------
def _set_node(d, key, new_key, value_len):
    node = _node(d, key)
    node.key, node.value = new_key, node.value[:value_len]


def _heap_drops_leaf(d):
    """The evictable leaf's live heap entry goes stale (its version shifted)."""
    pc = d.cm.prefix_cache
    leaf = _node(d, [7, 7, 7, 7])
    pc._leaves = [(a, i, v - (n is leaf and v == n.version), n) for a, i, v, n in pc._leaves]
    heapq.heapify(pc._leaves)


def _heap_holds_locked_leaf(d):
    node = _node(d, [9, 9])
    heapq.heappush(d.cm.prefix_cache._leaves, (node.last_access, node.id, node.version, node))


def _set_attr(key, name, value):
    def plant(d):
        setattr(_node(d, key), name, value(d) if callable(value) else value)

    return plant


# name -> (plant, message), on both implementations. The naive caches' check_integrity has no clause.
RADIX_CASES = {
    "empty node": (lambda d: _set_node(d, [7, 7, 7, 7], [], 0), r"radix node 3 has key length 0, value length 0"),
    "key not whole pages": (
        lambda d: _set_node(d, [7, 7, 7, 7], [7, 7, 7], 3),
        r"radix node 3 has key length 3, value length 3",
    ),
    "value shorter than key": (
        lambda d: _set_node(d, [7, 7, 7, 7], [7, 7, 7, 7], 2),
        r"radix node 3 has key length 4, value length 2",
    ),
    "key off its parent's edge": (
        _set_attr([9, 9], "key", [9, 8]),
        r"radix node 2 is not its parent's child under its first page",
    ),
    "parent not holding it": (
        _set_attr([9, 9], "parent", lambda d: d.cm.prefix_cache.root),
        r"radix node 2 is not its parent's child under its first page",
    ),
    "lock count below children's": (_set_attr([9, 9], "ref_count", 3), r"radix node 1 lock count 2 < its children's 3"),
    "evictable size": (_radix_recount, r"radix sizes recount to evictable=4 protected=6, recorded 6 6"),
    "protected size": (
        lambda d: setattr(d.cm.prefix_cache, "protected_size", 4),
        r"radix sizes recount to evictable=4 protected=6, recorded 4 4",
    ),
}
# fast's radix cache only: its values are tensors, and it keeps a heap of evictable leaves
FAST_RADIX_CASES = {
    "value dtype": (
        _set_attr([7, 7, 7, 7], "value", lambda d: _node(d, [7, 7, 7, 7]).value.long()),
        r"radix node 3 value is torch\.int64 on cpu",
    ),
    "value device": (
        _set_attr([7, 7, 7, 7], "value", lambda d: _node(d, [7, 7, 7, 7]).value.to("meta")),
        r"radix node 3 value is torch\.int32 on meta",
    ),
    "heap misses an evictable leaf": (_heap_drops_leaf, r"evictable-leaf heap holds \[\], tree has \[3\]"),
    "heap holds a locked leaf": (_heap_holds_locked_leaf, r"evictable-leaf heap holds \[2, 3\], tree has \[3\]"),
}


def _check_radix_clause(impl, plant, message):
    d = _driver(impl)
    d.cm.prefix_cache.check_integrity()
    plant(d)
    with pytest.raises(RuntimeError, match=f"^integrity: {message}"):
        d.cm.prefix_cache.check_integrity()


@pytest.mark.parametrize("case", RADIX_CASES)
def test_radix_cache_clause(impl, case):
    _check_radix_clause(impl, *RADIX_CASES[case])


@pytest.mark.parametrize("case", FAST_RADIX_CASES)
def test_fast_radix_cache_clause(case):
    _check_radix_clause(fast, *FAST_RADIX_CASES[case])


# -- CacheScheduler.check: the judge (engine/ledger/invariants.py), then the implementation's own check ---
def _set_max_tokens(d, uid, max_tokens):
    """As if live `uid` had been submitted with `max_tokens`: the judge's record of the submission
    and the request's lengths agree (it was admitted with as many tokens as before)."""
    prompt, old = d.submitted[uid]
    d.submitted[uid] = (prompt, max_tokens)
    req = d.live[uid]
    req.max_device_len += max_tokens - old
    req.output_len += max_tokens - old


def _max_tokens(uid, max_tokens):
    return lambda d: _set_max_tokens(d, uid, max_tokens)


def _swap_handle_length(d):
    req = d.live[1]
    req.cache_handle = dataclasses.replace(req.cache_handle, cached_len=4)


def _provenance(loc, like):
    def plant(d):
        d.provenance.at[loc] = d.provenance.at[like]

    return plant


def _shift(attr, delta):
    def plant(d):
        setattr(d.live[0], attr, getattr(d.live[0], attr) + delta)

    return plant


# name -> (scenario, plant, invariant, message). tests/engine/ledger/test_invariants.py has a test per clause
# of the judge; these are the parts of its clauses that file leaves out (one operand of a
# condition, one caller of a shared check), invariant 3 again, and the implementation's own
# check, which reports what the judge does not look for (the radix cache's bookkeeping).
CHECK_CASES = {
    "implementation's own check": ("base", _radix_recount, "1-2-partition", r"integrity: radix sizes recount"),
    "1-2 key not whole pages": (
        "base",
        RADIX_CASES["key not whole pages"][0],
        "1-2-partition",
        r"cache node 3: key length 3, 3 locations, page size 2",
    ),
    "1-2 handle length not its node's": (
        "base",
        _swap_handle_length,
        "1-2-partition",
        r"uid 1: its row does not start with the 4 locations of the prefix",
    ),
    "8 output_len past max_tokens": (
        "base",
        lambda d: setattr(d.live[0], "output_len", 9),
        "8-request",
        r"uid 0: max_device_len 13 with output_len 9, but it was submitted with "
        r"5 \+ 8 tokens and holds 9",
    ),
    "8 cached_len": (
        "base",
        _shift("cached_len", -1),
        "8-request",
        r"uid 0: lengths handle 4, cached 7, device 9, with 9 tokens \(running\)",
    ),
    "3 reserve": (
        "base",
        _max_tokens(0, 19),
        "3-no-oom",
        r"live requests may still need 20 tokens of pages, only 18 available",
    ),
    "3 optimistic, live": (
        "preempted",
        _max_tokens(0, 27),
        "3-no-oom",
        r"uid 0 may need more than the pool's 12 tokens",
    ),
    "3 optimistic, waiting": (
        "preempted",
        lambda d: setattr(d.waiting[0].sampling_params, "max_tokens", 20),
        "3-no-oom",
        r"uid 1 may need more than the pool's 12 tokens",
    ),
    "7 cached location computed for other tokens": (
        "base",
        _provenance(15, 17),
        "7-kv-provenance",
        r"cache node 3: position 1 points at location 15, which "
        r"holds KV computed for other tokens",
    ),
}


@pytest.mark.parametrize("case", CHECK_CASES)
def test_scheduler_check_clause(impl, case):
    scenario, plant, invariant, message = CHECK_CASES[case]
    d = _driver(impl, scenario)
    plant(d)
    with pytest.raises(InvariantViolation, match=f"^\\[{invariant}\\] {message}") as e:
        d.check()
    assert e.value.invariant == invariant


# -- divergence.compare: invariants on each side, then every snapshot field -----------------------
def _lockstep(scenario):
    header, ops = SCENARIOS[scenario]
    lock = Lockstep(header)
    for op in ops:
        lock.apply(op)
    return lock


@pytest.mark.parametrize("side", ["reference", "fast"])
def test_compare_checks_each_side(side):
    lock = _lockstep("base")
    d = lock.ref if side == "reference" else lock.fast
    _set_free(d, _free(d)[1:])
    with pytest.raises(Finding) as e:
        compare(lock.ref, lock.fast, lock.step, {"op": "planted"})
    assert e.value.kind == ("reference-invariant" if side == "reference" else "invariant") + ":1-2-partition"


def _skew_property(obj, name, skew):
    """Give this one object a subclass whose property `name` reads skew(its true value): for the
    fields a valid state derives from fields compared before them, no state edit differs in them
    alone."""
    cls = type(obj)
    true = getattr(cls, name)
    obj.__class__ = type(f"Skewed{cls.__name__}", (cls,), {name: property(lambda self: skew(true.fget(self)))})


def _swap_table_slots(d):
    """uids 0 and 1 trade table slots, page-table and token-pool rows with them: only the slot
    numbers in `lens` differ."""
    a, b = d.live[0], d.live[1]
    a.table_idx, b.table_idx = b.table_idx, a.table_idx
    for table in (d.page_table, d.tm.token_pool):
        table[[a.table_idx, b.table_idx]] = table[[b.table_idx, a.table_idx]].clone()


def _swap_pages(d, uid_a, pos_a, uid_b, pos_b):
    """Two live pages trade places in the rows, their KV with them (as if it had been computed
    there: the judge's provenance map moves too)."""
    loc_a = int(d.page_table[d.live[uid_a].table_idx][pos_a])
    loc_b = int(d.page_table[d.live[uid_b].table_idx][pos_b])
    _write_row(d, uid_a, pos_a, range(loc_b, loc_b + PS))
    _write_row(d, uid_b, pos_b, range(loc_a, loc_a + PS))
    at = d.provenance.at
    for i in range(PS):
        at[loc_a + i], at[loc_b + i] = at[loc_b + i], at[loc_a + i]


def _admitted_one_more_token(d):
    """uid 0 counts its first sampled token as admitted (its output budget one less, its
    max_device_len the same), and its token-pool row holds it."""
    req = d.live[0]
    req.output_len -= 1
    d.tm.token_pool[req.table_idx][req.max_device_len - req.output_len - 1] = int(req.input_ids[5])


def _move_to_back(d):
    running = d.dm.running_reqs
    first = running.get(running.uids()[0])
    running.discard(first)
    running.add(first)


# snapshot field -> (scenario, plant on the fast side, Finding kind[, fields compared later that
# the plant changes too]). Each plant keeps fast's invariants and changes that field alone, except
# `owners`: under the invariants it is a function of free_slots, rows and lens (a page's owner is
# the free list, a row's owned part or the locked prefixes through it), so it cannot differ alone;
# it is compared before rows to name the page first. available_size and size_info are functions of
# free_slots and owners, hence the patched properties.
FIELD_CASES = {
    "free_slots": ("base", lambda d: _set_free(d, _free(d)[1:] + _free(d)[:1]), "state:free_slots"),
    "owners": ("base", lambda d: _swap_pages(d, 0, 6, 1, 8), "state:owner", ["rows"]),  # uids 0, 1 trade pages
    "rows": ("base", lambda d: _swap_pages(d, 0, 4, 0, 6), "state:rows"),
    "lens": ("base", _swap_table_slots, "state:lens"),
    "token_pool": ("base", _admitted_one_more_token, "state:token_pool"),
    "available_size": (
        "base",
        lambda d: _skew_property(d.cm, "available_size", lambda n: n + PS),
        "state:available_size",
    ),
    "size_info": (
        "base",
        lambda d: _skew_property(
            d.cm.prefix_cache, "size_info", lambda s: type(s)(s.evictable_size, s.protected_size + PS)
        ),
        "state:size_info",
        ["engine_reads"],  # the cached and locked pages the engine reads
    ),
    "table_free": ("base", lambda d: d.tm._free_slots.reverse(), "state:table_free"),
    # a reversed queue breaks first come, first served: the queue-order invariant names it first
    "waiting": ("base", lambda d: d.waiting.reverse(), "invariant:10-queue-order"),
    "running": ("base", _move_to_back, "state:running", ["engine_reads"]),  # the engine reads the order too
    "inflight_tokens": ("base", _max_tokens(0, 6), "state:inflight_tokens"),  # one page less to reserve
    "preemptions": ("preempted", lambda d: setattr(d, "preemptions", d.preemptions + 1), "state:preemptions"),
    "reserve_ratio": ("preempted", lambda d: setattr(d, "policy", d.policy.with_ratio(0.75)), "state:reserve_ratio"),
    # what the engine reads follows from the fields above, but is answered by methods of its own
    "engine_reads": ("base", lambda d: setattr(d, "next_uid", lambda: d.last_uid + 2), "state:engine_reads"),
}


def test_every_snapshot_field_has_a_case():
    lock = _lockstep("base")
    fields = set(lock.fast.snapshot())
    assert set(lock.ref.snapshot()) == fields
    assert not fields - set(FIELD_CASES), (
        f"snapshot fields with no planting case in FIELD_CASES: {fields - set(FIELD_CASES)}"
    )
    assert not set(FIELD_CASES) - fields, f"cases for fields the snapshot no longer has: {set(FIELD_CASES) - fields}"


@pytest.mark.parametrize("field", FIELD_CASES)
def test_compare_catches_a_difference_in_field(field):
    scenario, plant, kind, *also = FIELD_CASES[field]
    lock = _lockstep(scenario)
    op = {"op": "planted"}
    compare(lock.ref, lock.fast, lock.step, op)
    before = lock.fast.snapshot()
    assert before[field], f"{field} is trivial in scenario {scenario!r}"
    plant(lock.fast)
    after = lock.fast.snapshot()
    assert [k for k in before if before[k] != after[k]] == [field, *(also[0] if also else [])]
    with pytest.raises(Finding) as e:
        compare(lock.ref, lock.fast, lock.step, op)
    assert e.value.kind == kind
