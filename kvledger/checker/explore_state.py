"""The state key of `kvledger explore`: everything that decides the future, in a normal form, hashed.

Two states get the same key only if every operation sequence from one behaves, on reference and
on fast alike, as it does from the other (up to the renaming below). The key reads both sides of
a `Lockstep` in full, not the snapshot the harness compares: the snapshot leaves out state that
decides later steps (LRU clocks, node ids, fast's heap of evictable leaves, the adaptive policy's
observations, KV provenance).

Per side (reference and fast, each read from its own objects):
  queue      the waiting requests in order: uid, prompt (and output so far), max_tokens, and
             the live request it continues when mid-chunk
  live       the admitted requests in admission order (the order preemption picks victims):
             uid, class (mid-chunk or not), table slot, cached/device/max lengths, tokens, the
             handle (its length and its node), the row's pages up to its allocated end, its
             token-pool row
  running    the decode set's order; the last admission's prefix hits
  order      submission and admission numbers as ranks; which requests were preempted (and how
             much KV they had computed, which the recomputed-token count reads)
  pool       the free list in order, the free table slots in order
  cache      the radix tree node by node (parents first, children by key): key tokens, pages,
             lock count, last-access clock and creation id as ranks (eviction order is
             (last_access, id); a new node, touch or split always sorts after every existing
             one, so only the relative order matters); on fast also whether a node's value
             shares storage with the page table, and the heap's valid entries (clock and id
             ranks, the node), which decide which leaf pops next. Stale entries (an older
             version of their node, or a node evicted) are left out in canonical mode: versions
             only grow, so a stale entry never becomes valid again and `evict` skips it; they
             only decide when the heap is compacted, which changes no result
  policy     the reserve ratio, the adaptive policy's window of observed output fractions
  provenance KV location -> hash of the token prefix it encodes
Across both: fast's preemption and recomputed-token counts minus the reference's (zero in any
state that has not diverged: the counts are compared, their absolute values decide nothing).

Renaming (canonical mode), each a bijection applied consistently to both sides:
  uids       to their rank among the uids the state names (those in the system, and those
             the last admission's prefix hits name). The explorer submits increasing uids, so the
             rank keeps every comparison (sorted results, "newest first") the scheduler makes;
             the implementations use uids only as names. The next uid, the set of uids ever
             used and the submission counters drop out: a uid is never reused.
  pages      to their order of first appearance in the reference's state (free list, tree,
             then live rows), token locations page-wise (loc -> page' * page_size + offset).
             Sound as long as the implementations treat page numbers as names (hand-out order
             comes from the free list, not from the numbers); the divergence check compares the
             two sides location by location and is permutation-invariant.
Not renamed: token values (the alphabet is fixed and the next operations are generated from
it, so renamed tokens would not have the same futures), table slots (cheap to keep), and the
number of times a request was preempted beyond "at least once" and "twice or more" (it only
names an event).

Left out as never read before written: page-table and token-pool content past a live request's
allocated pages, rows of free table slots, and a request's token buffer past its length. A bug
that reads such stale memory can be merged with a state where the stale content differs; the
plain key (`canonical=False`) has the same omission, so compare against `merge=False` (no
merging at all) to rule that out for a given bug.

Plain mode (`canonical=False`) keeps raw uids, pages, clocks, ids and counters: exact-state
merging, the baseline the tests compare against.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Dict, List, NewType, Optional, Sequence, Tuple

from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.engine.ledger.invariants import tolist
from kvledger.properties.drivers import Driver
from kvledger.properties.lockstep import Lockstep

DIGEST = 16  # bytes of blake2b per stored key
StateKey = NewType("StateKey", bytes)  # a state's normal form, hashed: equal keys, equal futures


def digest(parts: Any) -> StateKey:
    return StateKey(hashlib.blake2b(repr(parts).encode(), digest_size=DIGEST).digest())


class _Names:
    """The uid and page renamings of one state (identity maps in plain mode)."""

    def __init__(self, ref: CacheScheduler, canonical: bool) -> None:
        self.canonical = canonical
        self.ps = ref.page_size
        self.uid: Dict[int, int] = {}
        self.page: Dict[int, int] = {}
        if not canonical:
            return
        # every uid the state names (a request that ended in the last prefill is still named by
        # its prefix hits), by value: the explorer submits increasing uids, so value order is
        # submission order
        named = set(ref._arrival) | set(ref.prefix_hits) | set(ref.live) | {p.uid for p in ref.waiting}
        for rank, uid in enumerate(sorted(named)):
            self.uid[uid] = rank
        ps = self.ps
        for loc in tolist(ref.cm.free_slots):
            self._see(loc)
        for node in ref.cm.prefix_cache.nodes():
            for loc in tolist(node.value)[::ps]:
                self._see(loc)
        for req in ref.live.values():
            end = -(-req.cached_len // ps) * ps
            for loc in tolist(ref.page_table[req.table_idx][:end])[::ps]:
                self._see(loc)

    def _see(self, loc: int) -> None:
        page = loc - loc % self.ps
        if page not in self.page:
            self.page[page] = len(self.page)

    def u(self, uid: int) -> Any:
        if not self.canonical:
            return uid
        return self.uid.get(uid, ("uid", uid))

    def locs(self, locations: Sequence[int]) -> Tuple[Any, ...]:
        if not self.canonical:
            return tuple(locations)
        ps, page = self.ps, self.page
        out = []
        for loc in locations:
            off = loc % ps
            p = page.get(loc - off)
            out.append(("raw", loc) if p is None else p * ps + off)
        return tuple(out)


def _ranks(values: Sequence[int]) -> Dict[int, int]:
    return {v: i for i, v in enumerate(sorted(set(values)))}


def _tree(sched: CacheScheduler, names: _Names, fast_side: bool) -> Tuple[Tuple[Any, ...], Dict[int, Any]]:
    """The prefix cache's structure, and id(node) -> the node's name (its index in nodes())."""
    cache = sched.cm.prefix_cache
    if not hasattr(cache, "root"):  # the naive cache holds nothing
        return (), {}
    nodes = cache.nodes()
    index: Dict[int, Any] = {id(n): i for i, n in enumerate(nodes)}
    index[id(cache.root)] = "root"
    heap = list(getattr(cache, "_leaves", ())) if fast_side else []
    if names.canonical:  # stale entries are skipped when popped and never valid again
        heap = [e for e in heap if e[2] == e[3].version and e[3].parent is not None]
    clock: Optional[Dict[int, int]] = None
    ids: Optional[Dict[int, int]] = None
    if names.canonical:
        clock = _ranks([n.last_access for n in nodes] + [e[0] for e in heap])
        ids = _ranks([n.id for n in nodes] + [e[1] for e in heap])
    table_storage = sched.page_table.untyped_storage().data_ptr() if fast_side else None
    out: List[Tuple[Any, ...]] = []
    for n in nodes:
        parent = index.get(id(n.parent), "detached")
        entry = [
            parent,
            tuple(n.key),
            names.locs(tolist(n.value)),
            n.ref_count,
            clock[n.last_access] if clock else n.last_access,
            ids[n.id] if ids else n.id,
        ]
        if fast_side:
            entry.append(n.value.untyped_storage().data_ptr() == table_storage)
            if not names.canonical:
                entry.append(n.version)
        out.append(tuple(entry))
    extra: Tuple[Any, ...] = ()
    if fast_side:
        entries = []
        for la, nid, version, node in heap:
            where = index.get(id(node))
            if where is None:
                where = ("detached", tuple(node.key), names.locs(tolist(node.value)), node.parent is None)
            valid = version == node.version
            entries.append((clock[la] if clock else la, ids[nid] if ids else nid, valid, repr(where)))
        extra = (tuple(sorted(entries)), cache._num_nodes)
    if not names.canonical:
        extra += (cache.clock, cache._next_id)
    return (tuple(out), extra), index


def _handle(handle: Any, index: Dict[int, Any], names: _Names) -> Tuple[Any, ...]:
    node = getattr(handle, "node", None)
    if node is None:
        where: Any = None
    elif id(node) in index:
        where = index[id(node)]
    else:  # evicted, or an old root: name it by content
        where = ("detached", tuple(node.key), names.locs(tolist(node.value)))
    return (handle.cached_len, where)


def side_key(sched: CacheScheduler, names: _Names, fast_side: bool) -> Tuple[Any, ...]:
    """One CacheScheduler's state, renamed (see the module docstring)."""
    ps = sched.page_size
    u = names.u
    tree, index = _tree(sched, names, fast_side)
    live = list(sched.live.values())
    live_pos = {id(r): i for i, r in enumerate(live)}
    reqs = []
    for r in live:
        end = -(-r.cached_len // ps) * ps
        prompt_end = r.max_device_len - r.output_len
        reqs.append(
            (
                u(r.uid),
                type(r).__name__,
                r.table_idx,
                r.cached_len,
                r.device_len,
                r.max_device_len,
                r.output_len,
                tuple(tolist(r.input_ids)),
                _handle(r.cache_handle, index, names),
                names.locs(tolist(sched.page_table[r.table_idx][:end])),
                tuple(tolist(sched.tm.token_pool[r.table_idx][:prompt_end])),
                r.sampling_params.max_tokens,
            )
        )
    waiting = tuple(
        (
            u(p.uid),
            tuple(tolist(p.input_ids)),
            p.output_len,
            None if p.chunked_req is None else live_pos.get(id(p.chunked_req), "not-live"),
        )
        for p in sched.waiting
    )
    admitted = sched._admitted_at
    if names.canonical:
        adm_rank = _ranks(list(admitted.values()))
        order: Tuple[Any, ...] = tuple(sorted((u(k), adm_rank[v]) for k, v in admitted.items()))
        preempted = tuple(sorted((u(k), c, min(t, 2)) for k, (c, t) in sched._preempted.items()))
        counters: Tuple[Any, ...] = ()
    else:
        order = (tuple(sorted(sched._arrival.items())), tuple(sorted(admitted.items())))
        preempted = tuple(sorted((k, c, t) for k, (c, t) in sched._preempted.items()))
        counters = (
            sched._submissions,
            sched._admissions,
            sched.last_uid,
            tuple(sorted(sched.known)),
            sched.preemptions,
            sched.recomputed_tokens,
        )
    observed = sched.observed_ratio
    policy = (
        sched.policy.kind,
        sched.policy.reserve_ratio,
        sched.dm.policy.reserve_ratio,
        None if observed is None else (observed.ratio, tuple(observed._fractions)),
        tuple(sorted((u(k), v) for k, v in sched._prompt_len.items())),
    )
    provenance: Tuple[Any, ...] = ()
    if sched.provenance is not None:
        locs = list(sched.provenance.at)
        provenance = tuple(sorted(zip(names.locs(locs), (sched.provenance.at[x] for x in locs)), key=repr))
    return (
        waiting,
        tuple(reqs),
        tuple(u(x) for x in sched.dm.running_reqs.uids()),
        tuple(sorted((u(k), v) for k, v in sched.prefix_hits.items())),
        order,
        preempted,
        names.locs(tolist(sched.cm.free_slots)),
        tuple(sched.tm.free_slots()),
        tree,
        policy,
        provenance,
        tuple(sorted(u(k) for k in sched.submitted)),
        counters,
    )


def lockstep_key(lock: Lockstep, canonical: bool = True) -> StateKey:
    """The key of a Lockstep's state (reference and fast): a blake2b digest of its normal form."""
    ref, fst = lock.ref, lock.fast
    names = _Names(ref, canonical)
    deltas = (fst.preemptions - ref.preemptions, fst.recomputed_tokens - ref.recomputed_tokens)
    return digest((side_key(ref, names, False), side_key(fst, names, True), deltas))


def subject_key(driver: Driver, canonical: bool = True) -> StateKey:
    """The key of a subject in judge mode: the driver's bookkeeping and the subject's View, uids
    renamed by submission order. A subject's hidden state (what its View does not show, e.g. an
    LRU order) is not in it: see docs/exploration.md."""
    view = driver.view()
    # the uids in the system: the driver keeps arrival numbers of ended requests too
    present = set(driver.waiting) | set(driver.running) | set(driver.live) | set(view.requests)
    order = sorted(present, key=lambda x: driver.arrival.get(x, -1))
    rank = {uid: i for i, uid in enumerate(order)}

    def u(x: int) -> Any:
        return rank.get(x, ("uid", x)) if canonical else x

    led = driver.witness
    admitted = {k: v for k, v in driver.admitted.items() if k in present}
    adm_rank = _ranks(list(admitted.values()))
    parts = (
        tuple(u(x) for x in driver.waiting),
        tuple(u(x) for x in driver.running),
        tuple(sorted(u(x) for x in driver.live)),
        tuple(sorted((u(k), v) for k, v in driver.max_tokens.items() if k in present)),
        tuple(sorted((u(k), adm_rank[v]) for k, v in admitted.items())),
        tuple(sorted(u(x) for x in driver.preempted)),
        tuple(sorted((u(k), tuple(v)) for k, v in led.tokens.items() if k in present)),
        tuple(sorted((u(k), v) for k, v in led.prompt_len.items() if k in present)),
        tuple(sorted((u(k), v) for k, v in led.computed.items())),
        tuple(sorted(led.written.items())),
        tuple(view.free),
        tuple(sorted((u(k), tuple(v)) for k, v in view.requests.items())),
        tuple(
            (e.locations, e.start, e.tokens, repr(e.key), e.lock)
            for e in sorted(view.cached, key=lambda e: (e.start or 0, e.locations))
        ),
        None if view.page_refs is None else tuple(sorted(view.page_refs.items())),
        tuple(sorted(view.counters.items())),
        None if view.waiting is None else tuple(u(x) for x in view.waiting),
        tuple((g.name, tuple(sorted((u(k), tuple(v)) for k, v in g.requests.items()))) for g in view.groups),
        tuple(sorted((u(k), tuple(v)) for k, v in view.preempted.items())),
        _driver_extra(driver, u),
        () if canonical else (tuple(sorted(driver.known)), driver.admissions),
    )
    return digest(parts)


def _driver_extra(driver: Any, u: Callable[[int], Any]) -> Tuple[Any, ...]:
    """What a scheduling driver keeps beyond the queues: drafts proposed, requests ending or
    loading, outputs still in flight (a call-level driver keeps none of it)."""
    in_flight = getattr(driver, "in_flight", None)
    if in_flight is None:
        return ()
    return (
        tuple(sorted((u(k), v) for k, v in driver.drafts.items())),
        tuple(sorted(u(x) for x in driver.ending)),
        tuple(sorted((u(k), v) for k, v in driver.loading.items())),
        tuple(tuple(sorted((u(k), repr(o)) for k, o in step.outputs.items())) for step in in_flight),
    )
