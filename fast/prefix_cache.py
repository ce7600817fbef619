"""Handles and results of the tensor prefix caches, and the naive cache that caches nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

import torch

from kvledger.reference.prefix_cache import InsertResult, MatchResult, SizeInfo

__all__ = ["CacheHandle", "InsertResult", "MatchResult", "NaivePrefixCache", "SizeInfo"]


@dataclass(frozen=True)
class CacheHandle:
    cached_len: int
    node: Any = None
    device: torch.device = torch.device("cpu")

    def get_matched_indices(self) -> torch.Tensor:
        values: List[torch.Tensor] = []
        node = self.node
        while node is not None and node.parent is not None:
            values.append(node.value)
            node = node.parent
        if not values:
            return torch.empty(0, dtype=torch.int32, device=self.device)
        return torch.cat(values[::-1])


class NaivePrefixCache:
    def __init__(self, page_size: int = 1, device: torch.device | str = "cpu") -> None:
        self.page_size = page_size
        self.device = torch.device(device)
        self._empty_handle = CacheHandle(0, None, self.device)
        self._empty = torch.empty(0, dtype=torch.int32, device=self.device)

    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult[CacheHandle]:
        return MatchResult(self._empty_handle)

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult[CacheHandle]:
        return InsertResult(0, self._empty_handle)

    def lock_handle(self, handle: CacheHandle, unlock: bool = False) -> None:
        pass

    def evict(self, size: int) -> torch.Tensor:
        if size > 0:
            raise RuntimeError(f"cannot evict {size} tokens: the naive cache holds none")
        return self._empty

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(0, 0)

    def nodes(self) -> List[Any]:
        return []

    def check_integrity(self) -> None:
        pass
