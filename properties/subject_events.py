"""The rare states judge mode must reach, and how an operation's View shows one was reached.

`kvledger check` and the fuzzer report the first sequence (or case) that reached each; a state a
subject's capabilities rule out is not expected of it.
"""

from __future__ import annotations

import os
from typing import FrozenSet, List, Sequence, Set

from kvledger.properties.subject import CachedEntry, Capabilities, View
from kvledger.properties.subject_judge import Witness

# the rare states every subject's generator must reach (kvledger check reports the first sequence)
SUBJECT_EVENTS = frozenset(
    {
        "hit: prefix hit",
        "hit: diverges inside a cached page",
        "hit: diverges after the first page of a cached entry",
        "hit: re-hit of cached pages no request holds",
        "hit: on a request still mid-prefill",
        "admission: refused",
        "prefill: chunked",
        "allocate: full pool with locked entries",
        "preempt: a running request preempted",
        "abort: mid-prefill",
        "driver: idle after work",
    }
)


# the rare states of what real managers do beyond the plain path, each expected of a subject
# whose capabilities make it reachable
SPECULATION_EVENTS = frozenset({"spec: a draft rejected", "spec: every draft accepted"})
AHEAD_EVENTS = frozenset({"ahead: a request holds slots past its tokens"})
IN_FLIGHT_EVENTS = frozenset({"async: a step scheduled before the previous one's outputs"})
EXTERNAL_EVENTS = frozenset(
    {
        "external: KV loaded from outside",
        "external: an asynchronous load completed",
        "external: aborted while its KV loads",
    }
)
WINDOW_EVENTS = frozenset({"window: positions dropped outside the window", "window: a prefix hit in every group"})
# a decode step that needs a new page while the pool has none free or evictable: only a subject
# that preempts gets through it (SGLang retracts, vLLM preempts)
EXHAUSTED_AT_DECODE = "decode: a new page needed on a pool with no free or evictable page"
SCHEDULING_EVENTS = frozenset({"preempt: two victims waiting to resume"})
# a request dropped mid-prefill after a chunk it computed went into the prefix cache (SGLang
# checkpoints a middle chunk at the next step's top and releases an aborted one without a
# checkpoint): expected of the radix-tree subjects that preempt (SGLang's); the other subjects'
# CI reports were measured without it
ABORT_AFTER_CHECKPOINT = "abort: mid-prefill after a chunk was checkpointed"

# the misfits' states (the call-level driver reports them), by the capability that makes each reachable
MISFIT_EVENTS = {
    "evicts_before_admit": frozenset({"admission: evicted, then refused"}),
    "chooses_victim": frozenset({"preempt: the subject chose a victim other than the newest"}),
    "preempt_keeps_pages": frozenset(
        {"admission: resumed on the pages it kept", "abort: a preempted request keeping pages"}
    ),
}


def expected_events(caps: Capabilities, groups: int = 0) -> FrozenSet[str]:
    """The rare states a subject with these capabilities (and `groups` KV groups past the first)
    can reach."""
    events = set(e for e in SUBJECT_EVENTS if caps.preempts or not e.startswith("preempt"))
    if caps.preempts:
        events.add(EXHAUSTED_AT_DECODE)
    if caps.preempts and caps.explicit_evict and caps.chunked_prefill and caps.prefill_publishes_to_cache:
        events.add(ABORT_AFTER_CHECKPOINT)
    if caps.schedules:
        events -= {"allocate: full pool with locked entries"}  # an allocation call of the driver's
        events |= SCHEDULING_EVENTS
    if caps.spec_tokens:
        events |= SPECULATION_EVENTS
    if caps.max_ahead:
        events |= AHEAD_EVENTS
    if caps.in_flight > 1:
        events |= IN_FLIGHT_EVENTS
    if caps.external_kv:
        events |= EXTERNAL_EVENTS
    if groups:
        events |= WINDOW_EVENTS
    for capability, reached in MISFIT_EVENTS.items():
        if getattr(caps, capability) and not caps.schedules:
            events |= reached
    return frozenset(events)


def pool_exhausted(view: View, page_size: int) -> bool:
    """No page is free and none can be evicted: every cached page is locked or held by a live request."""
    if not view.free:
        rows: List[Sequence[int | None]] = [*view.requests.values()]
        rows += [r for g in view.groups for r in g.requests.values()]
        held = {int(loc) // page_size for row in rows for loc in row if loc is not None}
        return all(e.lock or {int(loc) // page_size for loc in e.locations} <= held for e in view.cached)
    return False


def published_own_chunk(view: View, uid: int, hit: int, computed: int) -> bool:
    """Some position the request computed itself, [hit, computed), is in the prefix cache."""
    cached = {int(loc) for e in view.cached for loc in e.locations}
    return any(int(loc) in cached for loc in view.requests.get(uid, [])[hit:computed])


def ahead_of_tokens(view: View, witness: Witness, page_size: int) -> bool:
    """Some live request holds locations past the page its last token is on (over-allocation)."""
    for uid, row in view.requests.items():
        tokens = witness.tokens.get(uid)
        if tokens is not None and len(row) > -(-len(tokens) // page_size) * page_size:
            return True
    return False


def window_events(uid: int, hit: int, view: View) -> List[str]:
    """What a View with KV groups shows: positions dropped outside a window, a hit held in every group."""
    events = []
    if any(None in row for g in view.groups for row in g.requests.values()):
        events.append("window: positions dropped outside the window")
    if hit and view.groups and all(uid in g.requests for g in view.groups):
        events.append("window: a prefix hit in every group")
    return events


def hit_events(
    uid: int, hit: int, before: View, after: View, witness: Witness, mid_prefill: Set[int], page_size: int
) -> List[str]:
    """The rare states an admission with a prefix hit of `hit` tokens reached: `before` and `after`
    are the subject's View around the admission, `mid_prefill` the other requests admitted but
    still prefilling."""
    ps = page_size
    events = ["hit: prefix hit"]
    tokens = witness.tokens[uid]
    hit_pages = {int(loc) // ps for loc in after.requests.get(uid, [])[:hit]}
    held_before = {int(loc) // ps for row in before.requests.values() for loc in row}
    if hit_pages - held_before:
        events.append("hit: re-hit of cached pages no request holds")
    if any(hit_pages & {int(loc) // ps for loc in before.requests.get(u, [])} for u in mid_prefill):
        events.append("hit: on a request still mid-prefill")
    for entry in before.cached:
        prefix = _claimed(entry, witness)
        common = _shared(prefix, tokens)
        start = len(prefix) - len(entry.locations)
        if common >= len(tokens) or common >= len(prefix):
            continue
        if start < common and common % ps:
            events.append("hit: diverges inside a cached page")
        # a radix edge whose first page matched; a block chain whose first blocks matched
        elif common >= start + ps if entry.tokens is not None else common == start >= ps:
            events.append("hit: diverges after the first page of a cached entry")
    return events


def _claimed(entry: CachedEntry, witness: Witness) -> Sequence[int]:
    """The token prefix a cache entry stands for: its path (radix) or what its KV was written for."""
    if entry.tokens is not None:
        return entry.tokens
    found = witness.written.get(int(entry.locations[-1])) if entry.locations else None
    return witness.prefixes.get(found[0], ()) if found else ()


def full_with_locks(view: View, page_size: int) -> bool:
    """No page is free and uncached (the allocation must evict), while some cached entry is in use."""
    cached = {int(loc) // page_size for e in view.cached for loc in e.locations}
    if set(map(int, view.free)) - cached:
        return False
    held = {int(loc) // page_size for row in view.requests.values() for loc in row}
    return any(e.lock for e in view.cached) or bool(cached & held)


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    return len(os.path.commonprefix([list(a), list(b)]))
