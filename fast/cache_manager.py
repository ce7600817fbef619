"""The tensor CacheManager: the same page moves as `reference.cache_manager`, on CPU or CUDA.

`free_slots` is an int32 tensor of free pages' first token locations, handed out from the
front. Index arithmetic happens on the host (pinned when the device is CUDA), and each step's
new locations reach the page table in one indexed assignment.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterable, Iterator, List, Sequence, Tuple

import torch

from kvledger.reference.cache_manager import FREE, IntegrityError
from kvledger.reference.pages import div_ceil

from .prefix_cache import CacheHandle, MatchResult, NaivePrefixCache
from .radix_cache import RadixPrefixCache
from .requests import PendingReq, Req


def create_prefix_cache(type: str, page_size: int, device: torch.device | str = "cpu"):
    if type == "naive":
        return NaivePrefixCache(page_size, device)
    if type == "radix":
        return RadixPrefixCache(page_size, device)
    raise ValueError(f"cache type must be 'naive' or 'radix', got {type!r}")


class CacheManager:
    def __init__(self, num_pages: int, page_size: int, page_table: torch.Tensor, type: str) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
        if (page_table.shape[1]) % page_size:
            raise ValueError(
                f"page_table width ({page_table.shape[1]}) must be a multiple of page_size ({page_size}): "
                "a request's last page is written whole"
            )
        self.device = page_table.device
        self.num_pages = num_pages
        self.page_size = page_size
        self.page_table = page_table
        self.free_slots = torch.arange(num_pages, dtype=torch.int32, device=self.device) * page_size
        self.prefix_cache = create_prefix_cache(type, page_size, self.device)
        self._lazy: List[torch.Tensor] | None = None
        self._pin = self.device.type == "cuda"
        self._offsets = torch.arange(page_size, dtype=torch.int32, device=self.device)

    # -- allocation ---------------------------------------------------------------------------
    def _allocate(self, needed_pages: int) -> torch.Tensor:
        free = len(self.free_slots)
        if needed_pages > free:
            evicted = self.prefix_cache.evict((needed_pages - free) * self.page_size)
            self.free_slots = torch.cat([self.free_slots, evicted[:: self.page_size]])
        if needed_pages > len(self.free_slots):
            raise RuntimeError(f"out of pages: need {needed_pages}, have {len(self.free_slots)} after eviction")
        allocated = self.free_slots[:needed_pages]
        self.free_slots = self.free_slots[needed_pages:]
        return allocated

    def needed_size(self, reqs: Iterable[Req]) -> int:
        """Tokens of whole pages `allocate_paged(reqs)` would take (host arithmetic, no sync)."""
        ps = self.page_size
        return sum(div_ceil(r.device_len, ps) * ps - div_ceil(r.cached_len, ps) * ps for r in reqs)

    def allocate_paged(self, reqs: Sequence[Req]) -> None:
        """Give each request the pages for positions [cached_len, device_len) it lacks."""
        ps = self.page_size
        # one entry per new page (its row, its first column), not per token: a decode step gives
        # a page to a few of its requests, and a prefill to thousands of tokens
        rows: List[int] = []
        cols: List[int] = []
        for req in reqs:
            lo, hi = div_ceil(req.cached_len, ps) * ps, div_ceil(req.device_len, ps) * ps
            if hi > lo:
                rows += [req.table_idx] * ((hi - lo) // ps)
                cols += range(lo, hi, ps)
        if not rows:
            return
        pages = self._allocate(len(rows))
        # host-side indices (pinned on CUDA), then one indexed assignment on the device: page k's
        # tokens go to row rows[k], columns cols[k] + [0, ps), at locations pages[k] + [0, ps)
        index = torch.tensor([rows, cols], dtype=torch.int64, pin_memory=self._pin)
        index = index.to(self.device, non_blocking=True)
        offsets = self._offsets
        self.page_table[index[0].unsqueeze(1), index[1].unsqueeze(1) + offsets] = pages.unsqueeze(1) + offsets

    # -- freeing ------------------------------------------------------------------------------
    def release_rejected(self, req: Req, reserved_end: int) -> None:
        """Free the pages a speculative step took past the committed KV (see the reference)."""
        ps = self.page_size
        lo = div_ceil(req.cached_len, ps) * ps
        hi = div_ceil(reserved_end, ps) * ps
        if hi > lo:
            self._free(self.page_table[req.table_idx, lo:hi])

    def _free(self, indices: torch.Tensor) -> None:
        # A copy, not a view: the indices may come from a page-table row that is rewritten
        # (remapped or reused) before a lazy region ends.
        starts = indices[:: self.page_size].clone()
        if self._lazy is not None:
            self._lazy.append(starts)
        elif len(starts):
            self.free_slots = torch.cat([self.free_slots, starts])

    @contextmanager
    def lazy_free_region(self) -> Iterator[None]:
        """Frees inside the region reach the free list with one concatenation at its end."""
        if self._lazy is not None:
            raise RuntimeError("lazy_free_region cannot be nested")
        self._lazy = []
        try:
            yield
        finally:
            lazy, self._lazy = self._lazy, None
            if lazy:
                self.free_slots = torch.cat([self.free_slots, *lazy])

    # -- prefix cache -------------------------------------------------------------------------
    def match_req(self, req: PendingReq) -> MatchResult[CacheHandle]:
        return self.prefix_cache.match_prefix(req.input_ids[: req.input_len - 1])

    def lock(self, handle: CacheHandle) -> None:
        self.prefix_cache.lock_handle(handle)

    def unlock(self, handle: CacheHandle) -> None:
        self.prefix_cache.lock_handle(handle, unlock=True)

    @property
    def available_size(self) -> int:
        return len(self.free_slots) * self.page_size + self.prefix_cache.size_info.evictable_size

    def cache_req(self, req: Req, *, finished: bool) -> None:
        """Hand the request's KV to the prefix cache in four regions (see the reference)."""
        row = self.page_table[req.table_idx]
        locs = row[: req.cached_len]
        old = req.cache_handle
        hit, new = self.prefix_cache.insert_prefix(req.input_ids[: req.cached_len], locs)
        self.unlock(old)
        self._free(locs[old.cached_len : hit])
        if finished:
            self._free(locs[new.cached_len :])
            return
        if hit > old.cached_len:  # deviation from the seed: remap the row to the cache's copy
            row[old.cached_len : hit] = new.get_matched_indices()[old.cached_len : hit]
        req.cache_handle = new
        self.lock(new)

    # -- verification -------------------------------------------------------------------------
    def _owned(self, req: Req) -> torch.Tensor:
        ps = self.page_size
        start = req.cache_handle.cached_len
        end = div_ceil(req.cached_len, ps) * ps
        return self.page_table[req.table_idx, start:end:ps]

    def page_owners(self, reqs: Sequence[Req] = ()) -> Dict[int, Tuple]:
        owners: Dict[int, list] = {p * self.page_size: [] for p in range(self.num_pages)}

        def claim(locs: torch.Tensor, who: Tuple) -> None:
            for loc in locs.tolist():
                if loc not in owners:
                    raise IntegrityError(f"integrity: {who} holds location {loc}, not a page start in the pool")
                owners[loc].append(who)

        claim(self.free_slots, (FREE,))
        for node in self.prefix_cache.nodes():
            claim(node.value[:: self.page_size], ("cache", node.ref_count))
        for req in reqs:
            claim(self._owned(req), ("req", req.uid))
        return {p: tuple(o) for p, o in owners.items()}

    def check_integrity(self, reqs: Sequence[Req] = ()) -> None:
        """Prove the partition on tensors. `reqs` must be every live request."""
        self.prefix_cache.check_integrity()
        ps, n = self.page_size, self.num_pages
        nodes = self.prefix_cache.nodes()
        parts = [self.free_slots] + [node.value[::ps] for node in nodes] + [self._owned(r) for r in reqs]
        starts = torch.cat(parts).long().cpu() if parts else torch.empty(0, dtype=torch.long)
        if len(starts) and (bool((starts % ps != 0).any()) or bool((starts < 0).any()) or int(starts.max()) >= n * ps):
            raise IntegrityError("integrity: a free, cached or owned page start is misaligned or outside the pool")
        counts = torch.bincount(starts // ps, minlength=n)
        if bool((counts != 1).any()):
            page = int(torch.nonzero(counts != 1)[0])
            raise IntegrityError(
                f"integrity: {int((counts != 1).sum())} pages without exactly one owner, e.g. page {page} "
                f"(location {page * ps}) has {int(counts[page])} owners; free={len(self.free_slots)} "
                f"cached={sum(node.length for node in nodes) // ps} owned={sum(len(self._owned(r)) for r in reqs)}"
            )
        locks: Dict[int, int] = {}
        for req in reqs:
            row, handle = self.page_table[req.table_idx], req.cache_handle
            if not torch.equal(row[: handle.cached_len], handle.get_matched_indices()):
                raise IntegrityError(f"integrity: request {req.uid}'s row does not match its locked prefix")
            filled = row[: div_ceil(req.cached_len, ps) * ps].view(-1, ps)
            if not torch.equal(filled, filled[:, :1] + self._offsets):
                raise IntegrityError(f"integrity: request {req.uid}'s row is not page-contiguous")
            node = handle.node
            while node is not None and node.parent is not None:
                locks[node.id] = locks.get(node.id, 0) + 1
                node = node.parent
        for node in nodes:
            if node.ref_count != locks.get(node.id, 0):
                raise IntegrityError(
                    f"integrity: radix node {node.id} has lock count {node.ref_count}, "
                    f"but {locks.get(node.id, 0)} live requests hold it"
                )

    # -- eviction on demand ------------------------------------------------------------------------
    def evict(self, tokens: int) -> torch.Tensor:
        """Evict at least `tokens` tokens of unlocked prefix cache and free their pages; the evicted
        token locations (the cache scheduler's `evict` operation)."""
        evicted = self.prefix_cache.evict(tokens)
        self._free(evicted)
        return evicted
