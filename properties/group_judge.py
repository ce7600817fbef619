"""The judge's reading of request rows: every KV group's, and those of preempted requests that keep
their pages; who holds which page, and how far each row may reach.

A subject with several KV groups (`View.groups`: full attention plus a sliding window, vLLM's
hybrid coordinator, SGLang's SWA pool) serves them all from one pool, and each request holds one
row per group. A position a windowed group dropped (freed, or replaced by a null block) is None in
its row. A preempted request that keeps its pages (`View.preempted`) holds a row of the first
group until it is resumed or dropped. Every row is read here into one `Holders` map, from which
`subject_judge.py` judges the partition and the counts as for a single group:

  1-2-partition      each row (every group's, every preempted one's) is page-aligned and
                     page-contiguous, None positions aside; a page belongs to one KV group (rows
                     of two groups never hold the same page, nor does a cache entry of another
                     group); a cached entry of group n names a group the view has
  8-request          every group holds a row for exactly the live requests
  7-kv-provenance    in a group of window W, a live request that computed c positions holds KV
                     written for exactly its prefix at every position of [max(0, c - W + 1), c);
                     a group without a window, at every position of [0, c)
  11-over-allocation a request holds locations (in any group) for at most round_up(len(tokens) +
                     max_ahead, page_size) positions, `tokens` its prompt plus sampled tokens

A group with a pool of its own (`Capabilities.group_pools`, SGLang's SWA allocator) is judged as a
pool of its own too (`own_pools`, `check_pools`, `check_group_counters`):

  1-2-partition      its rows and cache entries hold only pages of its pool, and no other group's
                     rows or entries hold one; every page of its pool is in its free list (once),
                     held or cached, as for the first pool
  9-counters         its counters (`GroupView.counters`) equal its free list and its entries
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterator, List, NoReturn, Sequence, Set, Tuple

import numpy as np

from kvledger.engine.ledger.invariants import InvariantViolation, prefix_hashes
from kvledger.properties.subject import Capabilities, View

__all__ = [
    "Holders",
    "all_pages",
    "check_group_counters",
    "check_group_requests",
    "check_over_allocation",
    "check_pools",
    "check_windows",
    "group_name",
    "own_pools",
    "read_rows",
]

Row = Sequence[int | None]


def _fail(invariant: str, message: str) -> NoReturn:
    raise InvariantViolation(invariant, message)


def group_name(view: View, group: int) -> str:
    """How messages name KV group `group` (0: the first, `View.requests`)."""
    if group == 0:
        return "group 0"
    g = view.groups[group - 1]
    words = [g.name] if g.name and g.name != f"group {group}" else []
    words += [f"window {g.window}"] if g.window is not None else []
    words += [f"chunk {g.chunk}"] if g.chunk is not None else []
    return f"group {group} ({', '.join(words)})" if words else f"group {group}"


@dataclass
class Holders:
    """page -> {uid: the page's index in that uid's row}, over every group and every preempted row."""

    pages: Dict[int, Dict[int, int]] = field(default_factory=dict)
    group: Dict[int, int] = field(default_factory=dict)  # page -> the KV group whose rows hold it
    preempted: Set[int] = field(default_factory=set)  # holders that are preempted requests, not live

    def of(self, page: int) -> Dict[int, int]:
        return self.pages.get(page, {})

    def who(self, uids: Sequence[int]) -> str:
        """'live uid(s) [..]' and/or 'preempted uid(s) [..]', for messages."""
        live = sorted(u for u in uids if u not in self.preempted)
        kept = sorted(u for u in uids if u in self.preempted)
        words = ([f"live uid(s) {live}"] if live else []) + ([f"preempted uid(s) {kept}"] if kept else [])
        return " and ".join(words)


def rows(view: View) -> Iterator[Tuple[int, int, Row]]:
    """(group, uid, row) for every row the view shows: live rows of each group, then preempted rows
    (of the first group)."""
    for uid, row in sorted(view.requests.items()):
        yield 0, uid, row
    for n, g in enumerate(view.groups, start=1):
        for uid, grow in sorted(g.requests.items()):
            yield n, uid, grow
    for uid, prow in sorted(view.preempted.items()):
        yield 0, uid, prow


def read_rows(view: View, ps: int, pages: Set[int]) -> Holders:
    """Every row's pages, each row page-aligned and contiguous, each page in one group's rows."""
    holders = Holders(preempted=set(view.preempted))
    for group, uid, row in rows(view):
        where = f"uid {uid}" if group == 0 else f"uid {uid} ({group_name(view, group)})"
        if uid in holders.preempted and uid not in view.requests:
            where = f"preempted uid {uid}"
        for index, loc in _row_pages(row, ps, where):
            page = loc // ps
            if page not in pages:
                _fail("1-2-partition", f"{where}: position {index * ps} is at location {loc}, not in the pool")
            held = holders.pages.setdefault(page, {})
            other = holders.group.setdefault(page, group)
            if other != group:
                _fail(
                    "1-2-partition",
                    f"page {page} is in rows of two KV groups: {holders.who(sorted(held))} in "
                    f"{group_name(view, other)}, uid {uid} in {group_name(view, group)} (a block belongs to one group)",
                )
            if uid in held:
                _fail("1-2-partition", f"{where} holds page {page} at positions {held[uid] * ps} and {index * ps}")
            held[uid] = index
    return holders


def _row_pages(row: Row, ps: int, where: str) -> List[Tuple[int, int]]:
    """(index of the page-sized chunk, location of its first held position) for each chunk of
    `row` that holds any position; the row must be page-aligned and page-contiguous."""
    if not len(row):
        return []
    try:
        locs = np.asarray(row, dtype=np.int64).reshape(-1)
        dropped = False
    except TypeError:  # a None (dropped) position
        locs = np.asarray([-1 if loc is None else loc for loc in row], dtype=np.int64)
        dropped = True
    pos = np.arange(len(locs))
    if not dropped:
        anchor = pos - pos % ps
    else:  # the first held position of each chunk anchors it
        held = np.flatnonzero(locs >= 0)
        chunks, first = np.unique(held // ps, return_index=True)
        by_chunk = np.zeros(int(pos[-1] // ps) + 1, dtype=np.int64)
        by_chunk[chunks] = held[first]
        anchor = by_chunk[pos // ps]
    starts = locs[anchor]
    bad = (locs % ps != pos % ps) | (locs // ps != starts // ps)
    if dropped:
        bad &= locs >= 0
    if bad.any():
        i = int(bad.argmax())
        _fail(
            "1-2-partition",
            f"{where}: position {i} is at location {int(locs[i])}, not offset {i % ps} "
            f"of the page that holds position {int(anchor[i])} (location {int(starts[i])})",
        )
    if not dropped:
        return list(enumerate(locs[::ps].tolist()))
    firsts = np.unique(anchor[locs >= 0])
    return [(int(p) // ps, int(locs[p])) for p in firsts]


def check_group_requests(view: View, live: Set[int]) -> None:
    """Each KV group past the first holds a row for exactly the live requests."""
    for n, g in enumerate(view.groups, start=1):
        shown = set(g.requests)
        if shown != live:
            missing, extra = sorted(live - shown), sorted(shown - live)
            _fail(
                "8-request",
                f"{group_name(view, n)}: "
                + (f"live uids {missing} have no row" if missing else "")
                + ("; " if missing and extra else "")
                + (f"rows for uids {extra}, which are not live" if extra else ""),
            )


def check_windows(
    view: View, computed: Dict[int, int], tokens: Dict[int, List[int]], written: Dict[int, Tuple[int, int]]
) -> None:
    """A live request reads, in each group past the first, the positions its window covers: each
    must hold KV written for exactly its prefix."""
    for n, g in enumerate(view.groups, start=1):
        for uid in sorted(computed):
            c = computed[uid]
            row = g.requests[uid]
            low = g.first_read(c)
            hashes = prefix_hashes(tokens[uid][:c])
            for pos in range(low, c):
                loc = row[pos] if pos < len(row) else None
                if loc is None:
                    _fail(
                        "7-kv-provenance",
                        f"uid {uid}, {group_name(view, n)}: position {pos} has no location (dropped), but it "
                        f"computed {c} positions and the group reads [{low}, {c})",
                    )
                found = written.get(int(loc))
                if found is None or found[0] != hashes[pos]:
                    what = "was never computed" if found is None else "holds KV computed for other tokens"
                    _fail(
                        "7-kv-provenance",
                        f"uid {uid}, {group_name(view, n)}: position {pos} reads location {int(loc)}, which {what}",
                    )


def check_over_allocation(view: View, caps: Capabilities, tokens: Dict[int, List[int]]) -> None:
    """No row reaches past round_up(len(tokens) + max_ahead, page_size) positions."""
    ps, ahead = caps.page_size, caps.max_ahead
    for group, uid, row in rows(view):
        known = tokens.get(uid)
        if known is None:
            continue  # an unknown uid is 8-request's finding
        bound = -(-(len(known) + ahead) // ps) * ps
        if len(row) > bound:
            _fail(
                "11-over-allocation",
                f"uid {uid} holds locations for {len(row)} positions in {group_name(view, group)}, but it has "
                f"{len(known)} tokens and may hold at most {bound} (max_ahead {ahead}, rounded up to whole pages)",
            )


def _own(caps: Capabilities, group: int) -> bool:
    """Whether KV group `group` has a pool of its own."""
    return 1 <= group <= len(caps.group_pools) and bool(caps.group_pools[group - 1])


def all_pages(caps: Capabilities) -> Set[int]:
    """Every page a row or cache entry may hold: the first pool's and each own pool's."""
    return set(caps.pages).union(*caps.group_pools)


def own_pools(view: View, caps: Capabilities) -> List[Tuple[int, Set[int], List[int]]]:
    """(group, its pool's pages, its free list) for each KV group with a pool of its own."""
    pools = []
    for n, g in enumerate(view.groups, start=1):
        if _own(caps, n):
            if g.free is None:
                _fail("1-2-partition", f"{group_name(view, n)} has a pool of its own but the view shows no free list")
            pools.append((n, set(caps.group_pools[n - 1]), list(g.free)))
    return pools


def check_pools(view: View, caps: Capabilities, holders: Holders) -> None:
    """Each page held by a row or a cache entry is of its group's pool: its own pool's, or the
    first pool's for a group without one."""
    if not caps.group_pools:
        return
    owner = {page: n for n in range(1, len(caps.group_pools) + 1) for page in caps.group_pools[n - 1]}
    ps = caps.page_size

    def check(page: int, group: int, who: str) -> None:
        pool = owner.get(page, 0)
        if pool != (group if _own(caps, group) else 0):
            where = f"the pool of {group_name(view, pool)}" if pool else "the first pool"
            _fail(
                "1-2-partition",
                f"{who} of {group_name(view, group)} holds page {page}, which is a page of {where} "
                "(each pool's pages serve its own group)",
            )

    for page, group in sorted(holders.group.items()):
        check(page, group, holders.who(sorted(holders.of(page))))
    for n, entry in enumerate(view.cached):
        for page in sorted({int(loc) // ps for loc in entry.locations}):
            check(page, entry.group, f"cache {entry.name or f'entry {n}'}")


def check_group_counters(view: View, caps: Capabilities, holders: Holders) -> None:
    """A group's own counters equal its free list and its cache entries."""
    for n, g in enumerate(view.groups, start=1):
        if not g.counters:
            continue
        entries = [e for e in view.cached if e.group == n]
        locked = [e for e in entries if e.lock is not None]
        computed = {
            "free_pages": len(g.free or []),
            "used_pages": sum(1 for page, group in holders.group.items() if group == n and holders.of(page)),
            "evictable_tokens": sum(len(e.locations) for e in locked if not e.lock),
            "protected_tokens": sum(len(e.locations) for e in locked if e.lock),
            "cached_tokens": sum(len(e.locations) for e in entries),
        }
        for name, value in g.counters.items():
            if name not in computed:
                raise ValueError(f"{group_name(view, n)} counter {name!r} has no meaning to the judge")
            if value != computed[name]:
                _fail(
                    "9-counters",
                    f"the subject counts {name} = {value} in {group_name(view, n)}, "
                    f"its structures hold {computed[name]}",
                )
