"""Admission, and the running set whose reservation it respects.

A request is admitted only if what the policy reserves for it, plus what is reserved for the
running requests, fits in `available_size` (free pages plus the evictable part of the prefix
cache). Under `reserve` (the default) that is the worst case, so a running request never finds
the pool empty and nothing is ever preempted; under `optimistic` it is a fraction of the output,
and `preemption.py` makes room when a step does not fit (see `admission_policy.py`).
"""

from __future__ import annotations

from typing import Iterable, Tuple

from .admission_policy import RESERVE, AdmissionPolicy
from .cache_manager import CacheManager
from .events import note
from .prefix_cache import CacheHandle
from .requests import ChunkedReq, PendingReq, Req
from .running_reqs import RunningReqs
from .table import TableManager


class DecodeManager:
    def __init__(self, page_size: int = 1, policy: AdmissionPolicy = RESERVE) -> None:
        self.page_size = page_size
        self.policy = policy
        self.running_reqs: RunningReqs[Req] = RunningReqs()  # iterates requests, in admission order

    def filter_reqs(self, reqs: Iterable[Req]) -> None:
        for req in reqs:
            self.running_reqs.add(req)
        for req in self.running_reqs:
            if not req.can_decode:
                self.running_reqs.discard(req)

    def remove_req(self, req: Req) -> None:
        self.running_reqs.discard(req)

    @property
    def inflight_tokens(self) -> int:
        reserved = self.policy.reserved_tokens
        return sum(reserved(r.cached_len, r.device_len, r.max_device_len, self.page_size) for r in self.running_reqs)

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
        return self.policy.reserved_tokens(
            cached_len, req.input_len, req.input_len + req.output_len, self.cache_manager.page_size
        )

    def _try_allocate_one(self, req: PendingReq) -> Tuple[CacheHandle, int] | None:
        if self.table_manager.available_size == 0:
            note("admission: no table slot")
            return None
        cm = self.cache_manager
        handle = cm.match_req(req).cuda_handle
        need = self._need(handle.cached_len, req)
        if need + self.reserved_size > cm.available_size:
            note("admission: rejected")
            return None
        cm.lock(handle)
        # Locked, the hit is no longer evictable: available_size may have shrunk.
        if need + self.reserved_size > cm.available_size:
            note("admission: rejected only after locking the hit")
            cm.unlock(handle)
            return None
        table_idx = self.table_manager.allocate()
        n = handle.cached_len
        if n > 0:
            note("admission: prefix hit")
            self.table_manager.token_pool[table_idx][:n] = req.input_ids[:n]
            self.table_manager.page_table[table_idx][:n] = handle.get_matched_indices()
        return handle, table_idx

    def _add_one_req(self, pending: PendingReq, handle: CacheHandle, table_idx: int, cached_len: int) -> Req:
        chunk = min(self.token_budget, pending.input_len - cached_len)
        is_chunked = cached_len + chunk < pending.input_len
        self.token_budget -= chunk
        self.reserved_size += self._need(cached_len, pending)
        end = cached_len + chunk
        self.table_manager.token_pool[table_idx][cached_len:end] = pending.input_ids[cached_len:end]
        if is_chunked:
            note("prefill: chunked")
        cls = ChunkedReq if is_chunked else Req
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
