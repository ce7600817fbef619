"""The subject-independent judge: every invariant of a cache manager, from its raw `View`.

It reads the view (the subject's free structure, request rows, prefix-cache entries, counts) and
what the harness recorded (`Witness`: what was submitted, what each request holds computed, and
which token prefix each location's KV was written for), and does its own arithmetic. It calls no
method of the subject but `cache_key` (a hash-chained cache's own hash, to recompute a key).
The invariants keep the names of kvledger's own judge (`invariants.py`) where they mean the same:

  5-quiescence    with no live request and no preempted request holding pages, no entry is locked
                  and no page is referenced (but for the cache's own reference, where it holds one)
  1-2-partition   every page of the pool is free (once), held by requests (live, or preempted and
                  keeping their pages), or cached; a free page is held by no request (and is cached
                  only where the subject keeps cached pages in its free pool, where then every
                  cached page nobody holds must be); a page two requests hold is cached, at the same
                  positions; each row (of every KV group) is page-aligned and page-contiguous, and a
                  page belongs to one KV group (`group_judge.py`); reference and lock counts equal the
                  requests that hold the page or entry (live and preempted-holding, every group), plus
                  one where the prefix cache holds its own reference (`cache_holds_reference`: that
                  one rule covers page_refs and entry locks alike, so such a subject's evictable
                  entries are those at lock 1)
  8-request       the view's live requests are the harness's, in every KV group; each holds at least
                  what it computed; a prefix hit never covers the last prompt token (checked at
                  admission); a request listed as preempted and holding pages (`View.preempted`) is
                  one the driver preempted and did not admit again nor drop (`Witness.preempted`),
                  and only a subject that declares `preempt_keeps_pages` lists any
  9-counters      the subject's counters equal the structures they count
  7-kv-provenance every location a live request reads, and every cached entry, holds KV written for
                  exactly that prefix (for a hash-chained cache: its key is the key of the tokens
                  the KV was written for, `cache_key(tokens)` for group 0 and `cache_key(tokens, n)`
                  for group n); in a KV group of window W a request that computed c positions reads
                  [max(0, c - W + 1), c), and positions before that may be dropped (None).
                  Positions past `computed` (lookahead slots, drafts, rejected drafts) are never
                  read as valid: a cache entry holding one fails here
  11-over-allocation a request's row (each group) holds at most round_up(len(tokens) + max_ahead,
                  page_size) positions, `tokens` its prompt plus sampled tokens (`group_judge.py`);
                  judged for every subject (with max_ahead 0, every shipped subject's rows stay
                  within the page of their last token: measured)
  3-no-oom        (at allocation, by the driver) a subject promising worst-case admission never
                  fails an allocation of an admitted request
  4-failed-admission (by the driver) a refused admission leaves the view unchanged
  10-queue-order  (by the driver) the waiting queue is first come, first served, and a request
                  waiting again (preempted, mid-prefill) waits ahead of every request never admitted
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, NoReturn, Sequence, Set, Tuple

import numpy as np

from kvledger.engine.ledger.invariants import InvariantViolation, prefix_hashes
from kvledger.properties.group_judge import (
    Holders,
    all_pages,
    check_group_counters,
    check_group_requests,
    check_over_allocation,
    check_pools,
    check_windows,
    group_name,
    own_pools,
    read_rows,
)
from kvledger.properties.subject import CachedEntry, Capabilities, View

__all__ = ["InvariantViolation", "Witness", "judge"]


@dataclass
class Witness:
    """What the harness knows independently of the subject (what it saw submitted, computed and
    written), against which the subject's own View is judged."""

    tokens: Dict[int, List[int]] = field(default_factory=dict)  # uid -> prompt + sampled tokens
    prompt_len: Dict[int, int] = field(default_factory=dict)
    computed: Dict[int, int] = field(default_factory=dict)  # live uid -> positions with KV (hit included)
    # location -> (hash of the token prefix its KV encodes, that prefix's length)
    written: Dict[int, Tuple[int, int]] = field(default_factory=dict)
    prefixes: Dict[int, Tuple[int, ...]] = field(default_factory=dict)  # prefix hash -> the prefix
    # uids the driver preempted and has not admitted again nor dropped: the only ones a subject
    # with `preempt_keeps_pages` may list in `View.preempted`. The drivers fill it (subject_driver.py
    # at `preempt`, scheduling_driver.py at a Plan's `preempted`) and clear a uid at its admission,
    # abort or finish
    preempted: Set[int] = field(default_factory=set)

    def wrote(self, locations: Sequence[int], tokens: Sequence[int], start: int) -> None:
        """A forward pass computed positions [start, start + len(locations)) of `tokens`."""
        hashes = prefix_hashes(tokens[: start + len(locations)])
        for i, loc in enumerate(locations):
            pos = start + i
            self.written[int(loc)] = (hashes[pos], pos + 1)
            self.prefixes.setdefault(hashes[pos], tuple(tokens[: pos + 1]))

    def wrote_view(self, view: View, uid: int, tokens: Sequence[int], start: int, end: int) -> None:
        """A forward pass computed positions [start, end) of `tokens` for `uid`, in every KV group:
        its row of `view.requests` and its row of each `view.groups`, skipping dropped (None)
        positions and positions past a row's end."""
        end = min(end, len(tokens))
        hashes = prefix_hashes(tokens[:end])
        rows: List[Sequence[int | None]] = [view.requests.get(uid, [])]
        rows += [g.requests.get(uid, []) for g in view.groups]
        for row in rows:
            for pos in range(start, min(end, len(row))):
                loc = row[pos]
                if loc is not None:
                    self.written[int(loc)] = (hashes[pos], pos + 1)
                    self.prefixes.setdefault(hashes[pos], tuple(tokens[: pos + 1]))


def _fail(invariant: str, message: str) -> NoReturn:
    raise InvariantViolation(invariant, message)


def judge(view: View, caps: Capabilities, witness: Witness, subject: Any = None) -> None:
    """Every invariant over one view (see the module doc); InvariantViolation on the first broken."""
    ps = caps.page_size
    pages = set(caps.pages)
    live = set(witness.computed)
    own = 1 if caps.cache_holds_reference else 0  # the prefix cache's own reference on a cached page
    if not live and not view.preempted:
        _check_quiescence(view, ps, own)
    _check_requests(view, caps, witness, live)
    check_group_requests(view, live)
    holders = read_rows(view, ps, all_pages(caps))
    cached = _check_entries(view, ps, all_pages(caps), holders)
    check_pools(view, caps, holders)
    _check_partition(view, caps, holders, cached, pages)
    apart = own_pools(view, caps)  # KV groups with a pool of their own (group_judge.py)
    for _, pool, free in apart:
        _check_partition(replace(view, free=free), caps, holders, cached, pool)
    _check_counts(view, holders, cached, own)
    _check_counters(view, ps, holders, own, pages, {n for n, _, _ in apart})
    check_group_counters(view, caps, holders)
    check_over_allocation(view, caps, witness.tokens)
    _check_provenance(view, witness, subject)


def _check_quiescence(view: View, ps: int, own: int) -> None:
    locked = [e.name or str(e.locations[:2]) for e in view.cached if e.lock is not None and e.lock != own]
    if locked:
        _fail("5-quiescence", f"no live request, but cache entries {locked} are locked")
    page_refs = view.page_refs or {}
    cached = {int(loc) // ps for e in view.cached for loc in e.locations} if own else set()
    refs = sorted(p for p, n in page_refs.items() if n != (own if p in cached else 0))
    if refs:
        _fail(
            "5-quiescence",
            f"no live request, but pages {refs[:8]} have reference counts {[page_refs[p] for p in refs[:8]]}"
            + (" (the cache's own reference on a cached page aside)" if own else ""),
        )


def _check_requests(view: View, caps: Capabilities, witness: Witness, live: Set[int]) -> None:
    shown = set(view.requests)
    if shown != live:
        missing, extra = sorted(live - shown), sorted(shown - live)
        _fail(
            "8-request",
            (f"live uids {missing} are missing from the subject's requests" if missing else "")
            + ("; " if missing and extra else "")
            + (f"the subject still holds rows for uids {extra}, which are not live" if extra else ""),
        )
    for uid in sorted(live):
        if len(view.requests[uid]) < witness.computed[uid]:
            _fail(
                "8-request",
                f"uid {uid} computed {witness.computed[uid]} positions but holds locations "
                f"for {len(view.requests[uid])}",
            )
    kept = sorted(view.preempted)
    if kept and not caps.preempt_keeps_pages:
        _fail(
            "8-request",
            f"the subject lists uids {kept} as preempted and holding pages, but it does not declare "
            "preempt_keeps_pages",
        )
    stray = [uid for uid in kept if uid not in witness.preempted or uid in live]
    if stray:
        _fail(
            "8-request",
            f"uids {stray} hold pages as preempted requests, but the driver did not preempt them "
            "(or admitted them again, or dropped them, since)",
        )


def _check_entries(view: View, ps: int, pages: Set[int], holders: Holders) -> Dict[int, List[str]]:
    """page -> the names of the cache entries holding it."""
    cached: Dict[int, List[str]] = defaultdict(list)
    for n, entry in enumerate(view.cached):
        name = entry.name or f"entry {n}"
        if not 0 <= entry.group <= len(view.groups):
            _fail(
                "1-2-partition",
                f"cache {name} belongs to KV group {entry.group}, but the view has {len(view.groups) + 1} group(s)",
            )
        if entry.tokens is not None and len(entry.tokens) != (entry.start or 0) + len(entry.locations):
            _fail(
                "1-2-partition",
                f"cache {name}: {len(entry.locations)} locations from position {entry.start}, "
                f"but it claims {len(entry.tokens)} tokens",
            )
        for loc in sorted({int(x) - int(x) % ps for x in entry.locations}):
            page = loc // ps
            if page not in pages:
                _fail("1-2-partition", f"cache {name} holds location {loc}, not in the pool")
            group = holders.group.get(page, entry.group)
            if group != entry.group:
                _fail(
                    "1-2-partition",
                    f"cache {name} of {group_name(view, entry.group)} holds page {page}, which "
                    f"{holders.who(sorted(holders.of(page)))} hold in {group_name(view, group)} "
                    "(a block belongs to one group)",
                )
            cached[page].append(name)
    return cached


def _check_partition(
    view: View, caps: Capabilities, holders: Holders, cached: Dict[int, List[str]], pages: Set[int]
) -> None:
    free = np.asarray(view.free, dtype=np.int64).reshape(-1)
    counts: Dict[int, int] = defaultdict(int)
    for page in free.tolist():
        if page not in pages:
            _fail("1-2-partition", f"the free list holds {page}, not a page of the pool")
        counts[page] += 1
        if counts[page] == 2:
            _fail("1-2-partition", f"page {page} is in the free list twice")
    for page in sorted(pages):
        held, names, is_free = holders.pages.get(page, {}), cached.get(page, []), counts.get(page, 0) > 0
        if is_free and held:
            _fail("1-2-partition", f"page {page} is free, but {holders.who(sorted(held))} hold it")
        if is_free and names and not caps.cached_pages_in_free_pool:
            _fail("1-2-partition", f"page {page} is free and cached ({', '.join(names)})")
        if len(names) > 1:
            _fail("1-2-partition", f"page {page} is cached twice ({', '.join(names)})")
        if len(held) > 1:
            if not names:
                _fail(
                    "1-2-partition",
                    f"page {page} is held by uids {sorted(held)} but not cached: shared outside the prefix cache",
                )
            if len(set(held.values())) > 1:
                _fail(
                    "1-2-partition",
                    f"page {page} is held by uids {sorted(held)} at different positions "
                    f"{sorted(i * caps.page_size for i in held.values())}",
                )
        if not (is_free or held or names):
            _fail(
                "1-2-partition",
                f"page {page} is owned by nobody: not free, not cached, held by no live request (a leak)",
            )
        if names and not (held or is_free) and caps.cached_pages_in_free_pool:
            _fail(
                "1-2-partition",
                f"page {page} is cached ({', '.join(names)}) and held by no live request, but "
                "not in the free queue, where this subject keeps such pages: it is never "
                "reused (a leak)",
            )


def _holding(uids: List[int], holders: Holders) -> str:
    """'2 live request(s) [1, 2]', or with preempted holders '2 request(s) (live uid(s) [1] and ...)'."""
    if any(u in holders.preempted for u in uids):
        return f"{len(uids)} request(s) ({holders.who(uids)})"
    return f"{len(uids)} live request(s) {uids}"


def _check_counts(view: View, holders: Holders, cached: Dict[int, List[str]], own: int) -> None:
    """Reference and lock counts equal their holders (plus the cache's own reference, `own`)."""
    mine = " plus the prefix cache's own reference" if own else ""
    for page, refs in sorted((view.page_refs or {}).items()):
        held = sorted(holders.of(page))
        if refs != len(held) + (own if page in cached else 0):
            ours = mine if page in cached else ""
            _fail(
                "1-2-partition", f"page {page} has reference count {refs}, but {_holding(held, holders)} hold it{ours}"
            )
    for n, entry in enumerate(view.cached):
        if entry.lock is None or entry.start is None:
            continue
        a, b = entry.start, entry.start + len(entry.locations)
        want = list(entry.locations)
        rows: Dict[int, Sequence[int | None]] = {**view.requests, **view.preempted}
        if entry.group:
            rows = dict(view.groups[entry.group - 1].requests)
        locking = sorted(uid for uid, row in rows.items() if list(row[a:b]) == want)
        if entry.lock != len(locking) + own:
            _fail(
                "1-2-partition",
                f"cache {entry.name or f'entry {n}'} (positions [{a}, {b})) has lock count "
                f"{entry.lock}, but {_holding(locking, holders)} hold it{mine}",
            )


def _check_counters(view: View, ps: int, holders: Holders, own: int, pages: Set[int], apart: Set[int]) -> None:
    first = [e for e in view.cached if e.group not in apart]  # a group's own pool counts its own
    locked = [e for e in first if e.lock is not None]
    computed = {
        "free_pages": len(view.free),
        "used_pages": sum(1 for p, h in holders.pages.items() if h and p in pages),
        "evictable_tokens": sum(len(e.locations) for e in locked if e.lock == own),
        "protected_tokens": sum(len(e.locations) for e in locked if e.lock != own),
        "cached_tokens": sum(len(e.locations) for e in first),
    }
    computed["available_tokens"] = computed["free_pages"] * ps + computed["evictable_tokens"]
    for name, value in view.counters.items():
        if name not in computed:
            raise ValueError(f"view counter {name!r} has no meaning to the judge (known: {sorted(computed)})")
        if value != computed[name]:
            _fail("9-counters", f"the subject counts {name} = {value}, its structures hold {computed[name]}")


def _check_provenance(view: View, witness: Witness, subject: Any) -> None:
    for uid in sorted(witness.computed):  # first: a wrong reuse is named by the request that reads it
        tokens, n = witness.tokens[uid], witness.computed[uid]
        hashes = prefix_hashes(tokens[:n])
        row = view.requests[uid]
        for pos in range(n):
            found = witness.written.get(int(row[pos]))
            if found is None or found[0] != hashes[pos]:
                what = "was never computed" if found is None else "holds KV computed for other tokens"
                _fail("7-kv-provenance", f"uid {uid}: position {pos} reads location {int(row[pos])}, which {what}")
    check_windows(view, witness.computed, witness.tokens, witness.written)
    for n, entry in enumerate(view.cached):
        _check_entry(entry, entry.name or f"entry {n}", witness, subject)


def _check_entry(entry: CachedEntry, name: str, witness: Witness, subject: Any) -> None:
    if entry.tokens is not None:
        start = entry.start or 0
        hashes = prefix_hashes(entry.tokens)
        for i, loc in enumerate(entry.locations):
            found = witness.written.get(int(loc))
            if found is None or found[0] != hashes[start + i]:
                what = "was never computed" if found is None else "holds KV computed for other tokens"
                _fail("7-kv-provenance", f"cache {name}: position {start + i} is at location {int(loc)}, which {what}")
        return
    if entry.key is None:
        return
    last = witness.written.get(int(entry.locations[-1]))
    if last is None:
        _fail(
            "7-kv-provenance",
            f"cache {name} (key {entry.key!r:.24}) holds location {int(entry.locations[-1])}, which was never computed",
        )
    prefix = witness.prefixes[last[0]]
    start = len(prefix) - len(entry.locations)
    if start < 0 or (entry.start is not None and entry.start != start):
        _fail(
            "7-kv-provenance",
            f"cache {name}: its last location holds position {len(prefix) - 1}, not the end "
            f"of an entry of {len(entry.locations)} positions from {entry.start}",
        )
    hashes = prefix_hashes(prefix)
    for i, loc in enumerate(entry.locations):
        if witness.written.get(int(loc), (None,))[0] != hashes[start + i]:
            _fail(
                "7-kv-provenance",
                f"cache {name}: location {int(loc)} does not hold position {start + i} of "
                "the prefix its last location was written for",
            )
    want = subject.cache_key(prefix, entry.group) if entry.group else subject.cache_key(prefix)
    if want != entry.key:
        _fail(
            "7-kv-provenance",
            f"cache {name} is filed under key {entry.key!r:.24}, but its KV was written for "
            f"{len(prefix)} tokens whose key is {want!r:.24} (a hit there reads KV of "
            "another prefix)",
        )
