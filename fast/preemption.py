"""Preemption over the tensor cache manager: the same victims and page moves as the reference's
`preemption.py` (newest live request first; its KV to the prefix cache; its slot freed)."""

from __future__ import annotations

from dataclasses import replace
from typing import List, Sequence

from .cache_manager import CacheManager
from .requests import PendingReq, Req
from .table import TableManager


class Preemptor:
    def __init__(self, cache_manager: CacheManager, table_manager: TableManager) -> None:
        self.cache_manager = cache_manager
        self.table_manager = table_manager

    def make_room(self, batch: Sequence[Req], live: Sequence[Req]) -> List[Req]:
        """Preempt live requests, newest first, until the pages `batch` lacks fit; the victims."""
        cm = self.cache_manager
        keep = {id(r): r for r in batch}
        victims: List[Req] = []
        newest_first = list(live)[::-1]
        while cm.needed_size(keep.values()) > cm.available_size:
            if len(victims) + 1 >= len(newest_first):
                raise RuntimeError(
                    f"out of pages: only the oldest request is left and the batch needs "
                    f"{cm.needed_size(keep.values())} tokens of pages, {cm.available_size} available"
                )
            victim = newest_first[len(victims)]
            keep.pop(id(victim), None)
            self.preempt(victim)
            victims.append(victim)
        return victims

    def preempt(self, req: Req) -> None:
        self.table_manager.free(req.table_idx)
        self.cache_manager.cache_req(req, finished=True)

    @staticmethod
    def resumed(req: Req) -> PendingReq:
        ids = req.input_ids.clone()  # the request's buffer is not ours to keep
        return PendingReq(req.uid, ids, replace(req.sampling_params, max_tokens=req.max_device_len - len(ids)))
