"""The adapter for cache managers with mini-sglang's API: its `CacheManager` (20fcd7f) with
its `PrefillAdder`, `TableManager` and `DecodeManager`, and kvledger's own `fast` and `reference`,
which expose the same names.

`MinisglApiSubject` plays mini-sglang's scheduler (`python/minisgl/scheduler/`) one driver call at a
time, in the order that scheduler makes the same calls:

  admit      `PrefillManager.schedule_next_batch`: one `PrefillAdder` per prefill batch, created
             with the decode manager's `inflight_tokens` as its reservation, `try_add_one` for
             each request from the queue head (a request mid-prefill is at the head, and is
             added again, without a new match, before any other)
  allocate   `Scheduler._prepare_batch`: `allocate_paged` (here per request, in batch order: the
             pages come off the front of the free list in the same order as for the batch)
  computed   `Engine.forward_batch` (`complete_one`), `Scheduler._forward` (`filter_reqs`), then
             `_process_last_data` inside `lazy_free_region`: a request mid-prefill is skipped; the
             others get their token, and either finish at their max_tokens (`_free_req_resources`:
             table slot, then `cache_req(finished=True)`) or, in a prefill, `cache_req(finished=False)`
  finish     a stop decided by the driver: the same release, in its own `lazy_free_region`
  abort      `_process_one_msg(AbortBackendMsg)`: `PrefillManager.abort_req`, else
             `DecodeManager.abort_req`, then `_free_req_resources`
  evict      `prefix_cache.evict(tokens)`, the caller freeing the indices (as `_allocate` does)
  view       `free_slots // page_size`; each live request's page-table row up to `cached_len` (the
             positions with KV, the hit included), or up to `device_len` between its `allocate`
             and its `computed` (after `complete_one`, `device_len` already counts the next
             position, whose page is not allocated yet: the row there is stale); one entry per
             radix node (its path from the root, its value, its `ref_count`); `size_info` and
             `available_size` as the counters

Where the driver's granularity differs from one scheduler loop: each call is its own lazy-free
region (the judge reads the free list after every call), and a stop token is known only after
`computed`, so a request stopped at its prefill was first `cache_req(finished=False)` (the
prefix it inserts is the one `finished=True` would insert; its tail is freed at `finish`).
What differs between module sets (building, the token type, reading trees) is in `MinisglApiModules`.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Hashable, Iterable, List, Sequence, Set, Tuple

from kvledger.properties.subject import CachedEntry, Capabilities, DriverMismatch, SubjectConfig, View
from kvledger.subjects.edits import EditError, SourceEdit, bind


@dataclass(frozen=True)
class MinisglApiModules:
    """One module set with mini-sglang's cache API, and how to build and read it."""

    PrefillAdder: Callable[..., Any]  # (token_budget, reserved_size, cache_manager, table_manager)
    ChunkedReq: type
    managers: Callable[[SubjectConfig], Tuple[Any, Any, Any]]  # -> CacheManager, TableManager, DecodeManager
    pending: Callable[[int, Sequence[int], int], Any]  # (uid, prompt, max_tokens) -> PendingReq
    token: Callable[[int], Any]  # a sampled token, as `Req.append_host` takes it
    tolist: Callable[[Any], List[int]]
    cached: Callable[[Any], List[CachedEntry]]  # the prefix cache's entries, read from its tree
    calls: Callable[[], ContextManager] = nullcontext  # wraps the adapter's calls into the subject's code


class MinisglApiSubject:
    def __init__(
        self,
        name: str,
        version: str,
        capabilities: Capabilities,
        mods: MinisglApiModules,
        config: SubjectConfig,
        edits: Sequence[SourceEdit] = (),
    ) -> None:
        self.name, self.version, self.capabilities, self.m = name, version, capabilities, mods
        self.cm, self.tm, self.dm = mods.managers(config)
        self._adder_edits = bind_edits([self.cm, self.tm, self.dm, self.cm.prefix_cache], edits, "PrefillAdder")
        self.waiting: Dict[int, Any] = {}  # uid -> PendingReq, as PrefillManager.pending_list (in order)
        self.live: Dict[int, Any] = {}  # uid -> its Req (a ChunkedReq mid-prefill), admitted until released
        self._adder: Any = None  # the prefill batch's PrefillAdder
        self._batch: Set[int] = set()  # its uids
        self._ran = True  # whether the batch ran
        self._allocated: Set[int] = set()  # uids whose [cached_len, device_len) has pages, not yet computed

    def submit(self, uid: int, prompt: Sequence[int], max_tokens: int) -> None:
        self.waiting[uid] = self.m.pending(uid, prompt, max_tokens)

    def admit(self, uid: int, budget: int) -> int | None:
        self._new_batch()
        for pending in list(self.waiting.values()):  # a chunked request ahead took its whole remaining prompt
            if pending.uid == uid:
                req = self._add(pending, budget)
                return None if req is None else req.cached_len
            if pending.chunked_req is not None and pending.uid not in self._batch:
                self._add(pending, pending.input_len - pending.chunked_req.cached_len)
        raise DriverMismatch(f"admit: uid {uid} is not waiting")

    def allocate(self, uid: int, start: int, end: int) -> bool:
        self._new_batch()
        pending = self.waiting.get(uid)
        if pending is not None and uid not in self._batch:  # its next chunk: try_add_one again
            self._add(pending, end - start)
        with self.m.calls():
            self.cm.allocate_paged([self._expect(uid, start, end)])
        self._allocated.add(uid)
        return True

    def computed(self, uid: int, start: int, end: int, token: int | None) -> None:
        req = self._expect(uid, start, end, token)
        self._ran = True
        self._allocated.discard(uid)
        with self.m.calls():
            req.complete_one()
            self.dm.filter_reqs([req])
            if token is None:
                return
            with self.cm.lazy_free_region():
                req.append_host(self.m.token(token))
                if not req.can_decode:
                    self._release(req)
                elif uid in self._batch:
                    self.cm.cache_req(req, finished=False)

    def finish(self, uid: int) -> None:
        if uid in self.live:  # else computed() released it at its max_tokens, as the scheduler does
            with self.m.calls(), self.cm.lazy_free_region():
                self._release(self.live[uid])

    def abort(self, uid: int) -> None:
        pending = self.waiting.pop(uid, None)
        if (req := pending.chunked_req if pending is not None else self.live.get(uid)) is not None:
            with self.m.calls():
                self._release(req)

    def preempt(self, uid: int) -> None:
        raise NotImplementedError(f"{self.name} does not preempt (capability preempts=False)")

    def evict(self, tokens: int) -> int:
        with self.m.calls():
            evicted = self.cm.prefix_cache.evict(tokens)
            # the subject's own free path: mini-sglang's CacheManager has no public one
            self.cm._free(evicted)
        return len(evicted)

    def view(self) -> View:
        ps, tolist, info, rows = self.cm.page_size, self.m.tolist, self.cm.prefix_cache.size_info, self.cm.page_table
        return View(  # a row's positions with KV ([0, cached_len), the hit included), the step's once allocated
            free=[loc // ps for loc in tolist(self.cm.free_slots)],
            cached=self.m.cached(self.cm.prefix_cache),
            requests={
                uid: tolist(rows[r.table_idx][: r.device_len if uid in self._allocated else r.cached_len])
                for uid, r in self.live.items()
            },
            counters={
                "free_pages": len(self.cm.free_slots),
                "evictable_tokens": info.evictable_size,
                "protected_tokens": info.protected_size,
                "available_tokens": self.cm.available_size,
            },
        )

    def cache_key(self, tokens: Sequence[int]) -> Hashable:
        raise NotImplementedError("a radix cache files prefixes by their path, not a key")

    def _new_batch(self) -> None:
        if self._ran:
            self._adder, self._batch, self._ran = None, set(), False

    def _add(self, pending: Any, budget: int) -> Any:
        if self._adder is None:
            self._adder = self.m.PrefillAdder(budget, self.dm.inflight_tokens, self.cm, self.tm)
            bind(self._adder, self._adder_edits)
        self._adder.token_budget = budget  # the driver's budget left, as the adder's own count would be
        with self.m.calls():
            req = self._adder.try_add_one(pending)
        if req is not None:  # schedule_next_batch: a chunked request stays queued, the others leave
            self._batch.add(pending.uid)
            self.live[pending.uid] = req
            pending.chunked_req = req if isinstance(req, self.m.ChunkedReq) else None
            if pending.chunked_req is None:
                del self.waiting[pending.uid]
        return req

    def _release(self, req: Any) -> None:  # DecodeManager.remove_req, Scheduler._free_req_resources
        self.dm.remove_req(req)
        self.tm.free(req.table_idx)
        self.cm.cache_req(req, finished=True)
        del self.live[req.uid]

    def _expect(self, uid: int, start: int, end: int, token: Any = ...) -> Any:
        req = self.live.get(uid)  # and computed's token is None for a ChunkedReq's chunk, only then
        if (
            req is None
            or (req.cached_len, req.device_len) != (start, end)
            or (token is not ... and (token is None) != isinstance(req, self.m.ChunkedReq))
        ):
            raise DriverMismatch(f"uid {uid}: the driver's [{start}, {end}) token {token} do not fit {req!r}")
        return req


def bind_edits(objects: Iterable[Any], edits: Sequence[SourceEdit], *later: str) -> List[SourceEdit]:
    """Bind each edit on the object whose class it names; return those for the classes in `later`
    (made per batch, bound when made)."""
    by_class = {type(obj).__name__: obj for obj in objects}
    deferred = []
    for edit in edits:
        cls = edit.split()[1][0]
        if cls in later:
            deferred.append(edit)
        elif cls in by_class:
            bind(by_class[cls], [edit])
        else:
            raise EditError(
                f"{edit.name}: {edit.target} is not a method of {', '.join(sorted(by_class) + list(later))}"
            )
    return deferred


def radix_entries(
    root: Any,
    children: Callable[[Any], Iterable[Any]],
    key: Callable[[Any], List[int]],
    value: Callable[[Any], List[int]],
    lock: Callable[[Any], int],
    name: Callable[[Any], str],
) -> List[CachedEntry]:
    """One entry per node below `root`, its tokens the whole path from the root."""
    entries: List[CachedEntry] = []
    stack: List[Tuple[Any, Tuple[int, ...]]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        for child in children(node):
            tokens = path + tuple(key(child))
            entries.append(
                CachedEntry(
                    locations=tuple(value(child)), start=len(path), tokens=tokens, lock=lock(child), name=name(child)
                )
            )
            stack.append((child, tokens))
    return entries
