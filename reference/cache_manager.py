"""The cache manager: moves pages between free, owned by one request, and cached.

`free_slots` holds the first token location of each free page, in the order pages will be
handed out (from the front; frees append at the back). The page table stores token locations.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterable, Iterator, List, Sequence, Tuple

from .events import note
from .pages import div_ceil
from .prefix_cache import CacheHandle, MatchResult, NaivePrefixCache
from .radix_cache import RadixPrefixCache
from .requests import PendingReq, Req

FREE = "free"


def create_prefix_cache(type: str, page_size: int, device: str = "cpu"):
    if type == "naive":
        return NaivePrefixCache(page_size)
    if type == "radix":
        return RadixPrefixCache(page_size)
    raise ValueError(f"cache type must be 'naive' or 'radix', got {type!r}")


class IntegrityError(RuntimeError):
    pass


class CacheManager:
    def __init__(self, num_pages: int, page_size: int, page_table: List[List[int]], type: str) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
        if (len(page_table[0]) if page_table else 0) % page_size:
            raise ValueError(
                f"page_table width ({len(page_table[0]) if page_table else 0}) must be a multiple of page_size ({page_size}): "  # noqa: E501
                "a request's last page is written whole"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.page_table = page_table
        self.free_slots: List[int] = [p * page_size for p in range(num_pages)]
        self.prefix_cache = create_prefix_cache(type, page_size)
        self._lazy: List[int] | None = None

    # -- allocation ---------------------------------------------------------------------------
    def _allocate(self, needed_pages: int) -> List[int]:
        if needed_pages > len(self.free_slots):
            note("allocate: evicts from the prefix cache")
            evicted = self.prefix_cache.evict((needed_pages - len(self.free_slots)) * self.page_size)
            self.free_slots += evicted[:: self.page_size]
        if needed_pages > len(self.free_slots):
            raise RuntimeError(f"out of pages: need {needed_pages}, have {len(self.free_slots)} after eviction")
        allocated, self.free_slots = self.free_slots[:needed_pages], self.free_slots[needed_pages:]
        return allocated

    def needed_size(self, reqs: Iterable[Req]) -> int:
        """Tokens of whole pages `allocate_paged(reqs)` would take."""
        ps = self.page_size
        return ps * sum(div_ceil(r.device_len, ps) - div_ceil(r.cached_len, ps) for r in reqs)

    def allocate_paged(self, reqs: Sequence[Req]) -> None:
        """Give each request the pages for positions [cached_len, device_len) it lacks."""
        ps = self.page_size
        spans = []
        for req in reqs:
            first, last = div_ceil(req.cached_len, ps), div_ceil(req.device_len, ps)
            if last > first:
                spans.append((req.table_idx, first, last))
        pages = self._allocate(sum(last - first for _, first, last in spans))
        for table_idx, first, last in spans:
            row = self.page_table[table_idx]
            for page in range(first, last):
                start = pages.pop(0)
                row[page * ps : (page + 1) * ps] = range(start, start + ps)

    # -- freeing ------------------------------------------------------------------------------
    def release_rejected(self, req: Req, reserved_end: int) -> None:
        """After a speculative step (`Req.verify`): free the pages it took past the committed KV,
        those of positions [cached_len, reserved_end) after the page holding the last committed
        position. The rejected positions inside that page stay the request's (never cached: the
        cache takes [0, cached_len)), and its next step writes over them."""
        ps = self.page_size
        lo, hi = div_ceil(req.cached_len, ps) * ps, div_ceil(reserved_end, ps) * ps
        if hi > lo:
            note("spec: rollback crosses a page boundary")
            self._free(self.page_table[req.table_idx][lo:hi])

    def _free(self, indices: Sequence[int]) -> None:
        starts = list(indices[:: self.page_size])
        if self._lazy is not None:
            self._lazy += starts
        else:
            self.free_slots += starts

    @contextmanager
    def lazy_free_region(self) -> Iterator[None]:
        """Frees inside the region reach the free list once, in order, when it ends."""
        if self._lazy is not None:
            raise RuntimeError("lazy_free_region cannot be nested")
        self._lazy = []
        try:
            yield
        finally:
            self.free_slots += self._lazy
            self._lazy = None

    # -- prefix cache -------------------------------------------------------------------------
    def match_req(self, req: PendingReq) -> MatchResult[CacheHandle]:
        # At least one prompt token must be computed to get logits: stop before the last one.
        return self.prefix_cache.match_prefix(req.input_ids[: req.input_len - 1])

    def lock(self, handle: CacheHandle) -> None:
        self.prefix_cache.lock_handle(handle)

    def unlock(self, handle: CacheHandle) -> None:
        self.prefix_cache.lock_handle(handle, unlock=True)

    @property
    def available_size(self) -> int:
        return len(self.free_slots) * self.page_size + self.prefix_cache.size_info.evictable_size

    def cache_req(self, req: Req, *, finished: bool) -> None:
        """Hand the request's computed KV to the prefix cache, region by region:

        [0, old)          already cached when admitted; the request held a lock on it
        [old, hit)        computed here, but the cache got the same prefix meanwhile: free ours
        [hit, new)        inserted now: ownership passes to the cache
        [new, cached_len) the tail shorter than a page: freed if finished, else kept
        """
        row = self.page_table[req.table_idx]
        locs = row[: req.cached_len]
        old = req.cache_handle
        hit, new = self.prefix_cache.insert_prefix(req.input_ids[: req.cached_len], locs)
        self.unlock(old)
        if hit > old.cached_len:
            note("cache_req: duplicate prefix freed" + (" at finish" if finished else " while running"))
        if hit < new.cached_len:
            note("cache_req: new prefix inserted")
        self._free(locs[old.cached_len : hit])
        if finished:
            if new.cached_len < req.cached_len:
                note("cache_req: partial tail page freed")
            self._free(locs[new.cached_len :])
            return
        # Deviation from the seed: a running request must not keep pointing at the pages it
        # just freed. Point its row at the cache's copy of the same tokens instead.
        if hit > old.cached_len:
            row[old.cached_len : hit] = new.get_matched_indices()[old.cached_len : hit]
        req.cache_handle = new
        self.lock(new)

    # -- verification -------------------------------------------------------------------------
    def _owned(self, req: Req) -> List[int]:
        """First locations of the pages `req` owns (between steps): past its cached prefix."""
        ps = self.page_size
        row = self.page_table[req.table_idx]
        start = req.cache_handle.cached_len // ps
        return [row[p * ps] for p in range(start, div_ceil(req.cached_len, ps))]

    def page_owners(self, reqs: Sequence[Req] = ()) -> Dict[int, Tuple]:
        """Page start -> owners, for every page: ('free',), ('req', uid) or ('cache', locks).
        A page with other than one owner shows up in check_integrity."""
        owners: Dict[int, list] = {p * self.page_size: [] for p in range(self.num_pages)}

        def claim(loc: int, who: Tuple) -> None:
            if loc not in owners:
                raise IntegrityError(f"integrity: {who} holds location {loc}, not a page start in the pool")
            owners[loc].append(who)

        for loc in self.free_slots:
            claim(loc, (FREE,))
        for node in self.prefix_cache.nodes():
            for loc in node.value[:: self.page_size]:
                claim(loc, ("cache", node.ref_count))
        for req in reqs:
            for loc in self._owned(req):
                claim(loc, ("req", req.uid))
        return {p: tuple(o) for p, o in owners.items()}

    def check_integrity(self, reqs: Sequence[Req] = ()) -> None:
        """Prove the partition. `reqs` must be every live request (admitted, not finished)."""
        self.prefix_cache.check_integrity()
        ps = self.page_size
        if len(set(self.free_slots)) != len(self.free_slots):
            raise IntegrityError("integrity: a page is in the free list twice")
        bad = [(p, o) for p, o in self.page_owners(reqs).items() if len(o) != 1]
        if bad:
            page, who = bad[0]
            raise IntegrityError(
                f"integrity: {len(bad)} pages without exactly one owner, e.g. page {page // ps} "
                f"(location {page}) owned by {list(who) or 'nobody'}"
            )
        locks: Dict[int, int] = {}
        for req in reqs:
            row, handle = self.page_table[req.table_idx], req.cache_handle
            if row[: handle.cached_len] != handle.get_matched_indices():
                raise IntegrityError(f"integrity: request {req.uid}'s row does not match its locked prefix")
            for pos in range(div_ceil(req.cached_len, ps) * ps):
                if row[pos] != row[pos - pos % ps] + pos % ps:
                    raise IntegrityError(f"integrity: request {req.uid}'s row is not page-contiguous at {pos}")
            node = handle.node
            while node is not None and node.parent is not None:
                locks[node.id] = locks.get(node.id, 0) + 1
                node = node.parent
        for node in self.prefix_cache.nodes():
            if node.ref_count != locks.get(node.id, 0):
                raise IntegrityError(
                    f"integrity: radix node {node.id} has lock count {node.ref_count}, "
                    f"but {locks.get(node.id, 0)} live requests hold it"
                )

    # -- eviction on demand ------------------------------------------------------------------------
    def evict(self, tokens: int) -> List[int]:
        """Evict at least `tokens` tokens of unlocked prefix cache and free their pages; the evicted
        token locations (the cache scheduler's `evict` operation)."""
        evicted = self.prefix_cache.evict(tokens)
        self._free(evicted)
        return evicted
