"""Admission over the tensor cache manager: worst-case or optimistic reservation (see the reference)."""

from __future__ import annotations

from typing import Iterable, Tuple

import torch

from kvledger.reference.admission_policy import RESERVE, AdmissionPolicy
from kvledger.reference.pages import div_ceil
from kvledger.reference.running_reqs import RunningReqs

from .cache_manager import CacheManager
from .prefix_cache import CacheHandle
from .requests import ChunkedReq, PendingReq, Req
from .table import TableManager


def _pages_to_finish(cached_len: int, max_device_len: int, page_size: int) -> int:
    # the last sampled token never gets KV: at most max_device_len - 1 positions are written
    return max(div_ceil(max_device_len - 1, page_size) - div_ceil(cached_len, page_size), 0)


def _reserved_pages(
    policy: AdmissionPolicy, cached_len: int, device_len: int, max_device_len: int, page_size: int
) -> int:
    """Pages still reserved for a request: to max_device_len (reserve), or to device_len plus the
    ratio of what it may still generate, rounded up, and at least its next token (optimistic)."""
    if not policy.preempts:
        return _pages_to_finish(cached_len, max_device_len, page_size)
    remaining = max_device_len - device_len
    grow = -(-remaining * round(policy.reserve_ratio * 1_000_000) // 1_000_000)
    end = device_len + (max(grow, 1) if remaining > 0 else 0)
    return _pages_to_finish(cached_len, end, page_size)


class DecodeManager:
    def __init__(self, page_size: int = 1, policy: AdmissionPolicy = RESERVE) -> None:
        self.page_size = page_size
        self.policy = policy
        self.running_reqs: RunningReqs[Req] = RunningReqs()  # iterates requests, in admission order

    def filter_reqs(self, reqs: Iterable[Req]) -> None:
        running = self.running_reqs
        add = running.add
        for req in reqs:
            if req.can_decode:
                add(req)
        for req in [r for r in running if not r.can_decode]:
            running.discard(req)

    def remove_req(self, req: Req) -> None:
        self.running_reqs.discard(req)

    @property
    def inflight_tokens(self) -> int:
        ps = self.page_size
        pages, policy = _reserved_pages, self.policy
        return ps * sum(pages(policy, r.cached_len, r.device_len, r.max_device_len, ps) for r in self.running_reqs)

    @property
    def runnable(self) -> bool:
        return bool(self.running_reqs)


class PrefillAdder:
    def __init__(
        self,
        token_budget: int,
        reserved_size: int,
        cache_manager: CacheManager,
        table_manager: TableManager,
        policy: AdmissionPolicy = RESERVE,
    ) -> None:
        self.token_budget = token_budget
        self.reserved_size = reserved_size
        self.cache_manager = cache_manager
        self.table_manager = table_manager
        self.policy = policy

    def _need(self, cached_len: int, req: PendingReq) -> int:
        ps = self.cache_manager.page_size
        return ps * _reserved_pages(self.policy, cached_len, req.input_len, req.input_len + req.output_len, ps)

    def _try_allocate_one(self, req: PendingReq) -> Tuple[CacheHandle, int] | None:
        if self.table_manager.available_size == 0:
            return None
        cm = self.cache_manager
        handle = cm.match_req(req).cuda_handle
        need = self._need(handle.cached_len, req)
        if need + self.reserved_size > cm.available_size:
            return None
        cm.lock(handle)
        if need + self.reserved_size > cm.available_size:  # the hit is now locked, not evictable
            cm.unlock(handle)
            return None
        table_idx = self.table_manager.allocate()
        n = handle.cached_len
        if n > 0:
            self.table_manager.token_pool[table_idx, :n].copy_(self._staged(req.input_ids[:n]), non_blocking=True)
            self.table_manager.page_table[table_idx, :n].copy_(handle.get_matched_indices())
        return handle, table_idx

    def _staged(self, ids: torch.Tensor) -> torch.Tensor:
        # from pageable memory a host-to-device copy first waits for the GPU to go idle
        return ids.pin_memory() if self.table_manager.token_pool.is_cuda else ids

    def _add_one_req(self, pending: PendingReq, handle: CacheHandle, table_idx: int, cached_len: int) -> Req:
        chunk = min(self.token_budget, pending.input_len - cached_len)
        end = cached_len + chunk
        self.token_budget -= chunk
        self.reserved_size += self._need(cached_len, pending)
        self.table_manager.token_pool[table_idx, cached_len:end].copy_(
            self._staged(pending.input_ids[cached_len:end]), non_blocking=True
        )
        cls = ChunkedReq if end < pending.input_len else Req
        return cls(
            pending.input_ids[:end],
            table_idx,
            cached_len,
            pending.output_len,
            pending.uid,
            pending.sampling_params,
            handle,
        )

    def try_add_one(self, pending: PendingReq) -> Req | None:
        if self.token_budget <= 0:
            return None
        if (chunked := pending.chunked_req) is not None:
            return self._add_one_req(pending, chunked.cache_handle, chunked.table_idx, chunked.cached_len)
        if (resource := self._try_allocate_one(pending)) is None:
            return None
        handle, table_idx = resource
        return self._add_one_req(pending, handle, table_idx, handle.cached_len)
