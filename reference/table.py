"""Table slots: one page-table row (token locations) and one token-pool row per live request."""

from __future__ import annotations

from typing import List


class TableManager:
    def __init__(self, max_running_reqs: int, page_table: List[List[int]]) -> None:
        if max_running_reqs > len(page_table):
            raise ValueError(f"max_running_reqs ({max_running_reqs}) exceeds page_table rows ({len(page_table)})")
        self.page_table = page_table
        self.token_pool = [[0] * len(row) for row in page_table]
        self._free_slots = list(range(max_running_reqs))

    @property
    def available_size(self) -> int:
        return len(self._free_slots)

    def allocate(self) -> int:
        if not self._free_slots:
            raise RuntimeError("no free table slot")
        return self._free_slots.pop(0)

    def free(self, table_idx: int) -> None:
        if table_idx in self._free_slots:
            raise RuntimeError(f"table slot {table_idx} freed twice")
        self._free_slots.append(table_idx)

    def free_slots(self) -> List[int]:
        return list(self._free_slots)


def make_page_table(rows: int, max_seq_len: int, device: str = "cpu") -> List[List[int]]:
    if str(device) != "cpu":
        raise ValueError(f"the reference model lives on the host, not {device!r}")
    return [[0] * max_seq_len for _ in range(rows)]
