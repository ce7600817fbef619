"""What a refused admission changed, in words: the `4-failed-admission` finding names it.

Loaded only on that failure path, so its literals never reach a derandomized Hypothesis run."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Tuple

from kvledger.properties.subject import View

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
    # a change _state sees but none of the above names: cached keys moved between locations
    return "; ".join(parts) or "cached entries changed key"
