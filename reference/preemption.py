"""Preemption, the other half of optimistic admission.

When a step's pages do not fit even after eviction, the most recently admitted live request is
preempted, again and again, until they fit. A victim's computed KV goes to the prefix cache (not
the free list), so when it is admitted again its re-prefill is mostly a prefix hit; its table slot
is freed; it resumes from its prompt plus every token it has generated, with the same
`max_device_len`. The oldest live request is never preempted: admission guarantees that any one
request alone fits the pool, so once the newer ones are gone it always fits.
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Sequence

from .cache_manager import CacheManager
from .events import note
from .requests import ChunkedReq, PendingReq, Req
from .table import TableManager


class Preemptor:
    def __init__(self, cache_manager: CacheManager, table_manager: TableManager) -> None:
        self.cache_manager = cache_manager
        self.table_manager = table_manager

    def make_room(self, batch: Sequence[Req], live: Sequence[Req]) -> List[Req]:
        """Preempt live requests, newest first (`live` is in admission order), until the pages
        `batch` lacks fit. Returns the victims in the order they were preempted."""
        cm = self.cache_manager
        candidates = list(live)
        victims: List[Req] = []
        running = [r for r in batch]
        while cm.needed_size(running) > cm.available_size:
            if len(candidates) <= 1:
                raise RuntimeError(
                    f"out of pages: the batch needs {cm.needed_size(running)} tokens of pages, "
                    f"{cm.available_size} available, and only the oldest request is left"
                )
            victim = candidates.pop()
            note("preempt: mid-chunk" if isinstance(victim, ChunkedReq) else "preempt: running request")
            if victim in running:
                running.remove(victim)
                note("preempt: a request of the step's own batch")
            else:
                note("preempt: a request outside the step's batch")
            self.preempt(victim)
            victims.append(victim)
        if len(victims) > 1:
            note("preempt: several victims in one step")
        return victims

    def preempt(self, req: Req) -> None:
        """Free the request's table slot and hand its computed KV to the prefix cache."""
        self.table_manager.free(req.table_idx)
        self.cache_manager.cache_req(req, finished=True)

    @staticmethod
    def resumed(req: Req) -> PendingReq:
        """The waiting request a preempted running one becomes: its prompt plus all it generated,
        allowed what it had left, so it may still grow to the same max_device_len."""
        ids = list(req.input_ids)
        params = replace(req.sampling_params, max_tokens=req.max_device_len - len(ids))
        return PendingReq(req.uid, ids, params)
