"""Table slots over tensors: the page table (token locations) and the token pool, one row per
live request; slot bookkeeping is a host list, handed out lowest-first like the model's."""

from __future__ import annotations

from typing import List

import torch


def make_page_table(rows: int, max_seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.zeros((rows, max_seq_len), dtype=torch.int32, device=device)


class TableManager:
    def __init__(self, max_running_reqs: int, page_table: torch.Tensor) -> None:
        if max_running_reqs > page_table.shape[0]:
            raise ValueError(f"max_running_reqs ({max_running_reqs}) exceeds page_table rows ({page_table.shape[0]})")
        self.page_table = page_table
        self.token_pool = torch.zeros_like(page_table)
        self._free_slots: List[int] = list(range(max_running_reqs))
        self._is_free = [True] * max_running_reqs

    @property
    def available_size(self) -> int:
        return len(self._free_slots)

    def allocate(self) -> int:
        if not self._free_slots:
            raise RuntimeError("no free table slot")
        idx = self._free_slots.pop(0)
        self._is_free[idx] = False
        return idx

    def free(self, table_idx: int) -> None:
        if self._is_free[table_idx]:
            raise RuntimeError(f"table slot {table_idx} freed twice")
        self._is_free[table_idx] = True
        self._free_slots.append(table_idx)

    def free_slots(self) -> List[int]:
        return list(self._free_slots)
