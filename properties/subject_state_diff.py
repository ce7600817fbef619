"""What a refused admission changed, in words: the `4-failed-admission` finding names it; and,
for a subject that evicts before it admits, whether the change is only that eviction.

Loaded only on those paths, so its literals never reach a derandomized Hypothesis run of a
subject whose refusals change nothing."""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, Iterable, List, Tuple

from kvledger.engine.ledger.finding import Finding
from kvledger.properties.subject import Capabilities, View

SHOWN = 5  # items named per kind of change; the rest are counted


def _capped(items: List[str]) -> str:
    more = len(items) - SHOWN
    return ", ".join(items[:SHOWN]) + (f" (+{more} more)" if more > 0 else "")


def _cached(view: View) -> Dict[Tuple[Tuple[int, ...], Any], int]:
    """Cached entries as (locations, lock) -> how many such entries."""
    out: Dict[Tuple[Tuple[int, ...], Any], int] = {}
    for entry in view.cached:
        key = (tuple(int(loc) for loc in entry.locations), entry.lock)
        out[key] = out.get(key, 0) + 1
    return out


def _entries(
    counts: Dict[Tuple[Tuple[int, ...], Any], int], other: Dict[Tuple[Tuple[int, ...], Any], int]
) -> List[str]:
    return [
        f"{list(locs)}" + ("" if lock is None else f" lock {lock}")
        for (locs, lock), n in sorted(counts.items())
        for _ in range(n - other.get((locs, lock), 0))
    ]


def _changed(before: Dict[Any, Any], after: Dict[Any, Any]) -> List[str]:
    keys = sorted(set(before) | set(after), key=str)
    return [f"{k}: {before.get(k)} -> {after.get(k)}" for k in keys if before.get(k) != after.get(k)]


def _multiset_minus(a: Iterable[int], b: Iterable[int]) -> List[str]:
    left = list(b)
    out = []
    for x in a:
        if x in left:
            left.remove(x)
        else:
            out.append(str(x))
    return out


def describe_change(before: View, after: View) -> str:
    """The differences between two Views that a refused admission must not make, '; '-joined."""
    parts: List[str] = []
    free_before, free_after = [int(p) for p in before.free], [int(p) for p in after.free]
    for label, pages in (
        ("pages left the free list", _multiset_minus(free_before, free_after)),
        ("pages joined the free list", _multiset_minus(free_after, free_before)),
    ):
        if pages:
            parts.append(f"{label}: {_capped(pages)}")
    rows_before = {u: [int(x) for x in r] for u, r in before.requests.items()}
    rows_after = {u: [int(x) for x in r] for u, r in after.requests.items()}
    if rows := _changed(rows_before, rows_after):
        parts.append(f"rows changed (uid: before -> after): {_capped(rows)}")
    cached_before, cached_after = _cached(before), _cached(after)
    for label, entries in (
        ("cached entries removed (locations[, lock])", _entries(cached_before, cached_after)),
        ("cached entries added (locations[, lock])", _entries(cached_after, cached_before)),
    ):
        if entries:
            parts.append(f"{label}: {_capped(entries)}")
    if refs := _changed(before.page_refs or {}, after.page_refs or {}):
        parts.append(f"page refs changed (page: before -> after): {_capped(refs)}")
    if counters := _changed(before.counters, after.counters):
        parts.append(f"counters changed: {_capped(counters)}")
    held_before = {u: [int(x) for x in r] for u, r in before.preempted.items()}
    held_after = {u: [int(x) for x in r] for u, r in after.preempted.items()}
    if held := _changed(held_before, held_after):
        parts.append(f"preempted requests' pages changed (uid: before -> after): {_capped(held)}")
    # a change _state sees but none of the above names: cached keys moved between locations
    return "; ".join(parts) or "cached entries changed key"


def _locations(view: View) -> List[Tuple[int, Any, str]]:
    """Every cached location as (location, its entry's lock, its entry's key), sorted."""
    return sorted((int(loc), e.lock, "" if e.key is None else str(e.key)) for e in view.cached for loc in e.locations)


def _minus(a: List[Tuple[int, Any, str]], b: List[Tuple[int, Any, str]]) -> List[Tuple[int, Any, str]]:
    """The items of `a` that `b` does not have, as multisets."""
    left = Counter(b)
    out = []
    for x in a:
        if left[x]:
            left[x] -= 1
        else:
            out.append(x)
    return out


def eviction_breach(before: View, after: View, page_size: int, own: int = 0) -> str | None:
    """None when `after` differs from `before` only by an eviction of cached prefixes nobody holds
    (`Capabilities.evicts_before_admit`): cached locations removed whose entry was unlocked and
    whose page no live or preempted request held, each evicted page back on the free list (or
    already there, where cached pages sit in the free pool), no page leaving it, and reference
    counts lowered on evicted pages only. Otherwise what breaks that, in words. Counters may
    change with the eviction; the judge checks them against the structures after the step. `own`
    is the lock an entry nobody uses shows (1 where the cache holds its own reference)."""
    ps = page_size
    rows_before = {u: [int(x) for x in r] for u, r in before.requests.items()}
    rows_after = {u: [int(x) for x in r] for u, r in after.requests.items()}
    if rows := _changed(rows_before, rows_after):
        return f"rows changed (uid: before -> after): {_capped(rows)}"
    kept_before = {u: [int(x) for x in r] for u, r in before.preempted.items()}
    kept_after = {u: [int(x) for x in r] for u, r in after.preempted.items()}
    if kept := _changed(kept_before, kept_after):
        return f"preempted requests' pages changed (uid: before -> after): {_capped(kept)}"
    held = {loc // ps for rows in (rows_before, kept_before) for row in rows.values() for loc in row}
    locs_before, locs_after = _locations(before), _locations(after)
    if added := _minus(locs_after, locs_before):
        return f"cached locations added (location, lock, key): {_capped([str(x) for x in added])}"
    removed = _minus(locs_before, locs_after)
    locked = [f"{loc} (lock {lock})" for loc, lock, _ in removed if lock and lock != own]
    if locked:
        return f"evicted locked cached locations: {_capped(locked)}"
    in_use = sorted({loc // ps for loc, _, _ in removed} & held)
    if in_use:
        return f"evicted cached pages a live or preempted request holds: {_capped([str(p) for p in in_use])}"
    evicted = {loc // ps for loc, _, _ in removed}
    still = {loc // ps for loc, _, _ in locs_after}
    free_before, free_after = [int(p) for p in before.free], [int(p) for p in after.free]
    if left := _multiset_minus(free_before, free_after):
        return f"pages left the free list: {_capped(left)}"
    strays = [p for p in _multiset_minus(free_after, free_before) if int(p) not in evicted - still]
    if strays:
        return f"pages joined the free list that were not evicted: {_capped(strays)}"
    refs_before, refs_after = before.page_refs or {}, after.page_refs or {}
    raised = [
        f"{p}: {refs_before.get(p)} -> {refs_after.get(p)}"
        for p in sorted(set(refs_before) | set(refs_after))
        if refs_before.get(p) != refs_after.get(p)
        and (p not in evicted or (refs_after.get(p) or 0) > (refs_before.get(p) or 0))
    ]
    if raised:
        return f"page refs changed on pages not evicted, or raised (page: before -> after): {_capped(raised)}"
    return None


def refusal_finding(uid: int, before: View, after: View, caps: Capabilities) -> Finding | None:
    """A refused admission of `uid` changed the view from `before` to `after`: the
    `4-failed-admission` finding, or None where the subject evicts before it admits and the
    change is only that eviction."""
    if caps.evicts_before_admit:
        breach = eviction_breach(before, after, caps.page_size, 1 if caps.cache_holds_reference else 0)
        if breach is None:
            return None
        return Finding(
            "4-failed-admission",
            f"refusing uid {uid} changed more than evicting cached prefixes nobody holds: {breach} "
            f"(all it changed: {describe_change(before, after)})",
        )
    return Finding(
        "4-failed-admission", f"refusing uid {uid} changed the subject's state: {describe_change(before, after)}"
    )
