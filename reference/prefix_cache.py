"""What every prefix cache returns, and the naive cache that caches nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, List, NamedTuple, TypeVar


class SizeInfo(NamedTuple):
    evictable_size: int  # tokens in unlocked nodes
    protected_size: int  # tokens in locked nodes

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size


@dataclass(frozen=True)
class CacheHandle:
    """A matched or inserted prefix: its length and the tree node it ends at (None if naive)."""

    cached_len: int
    node: Any = None

    def get_matched_indices(self) -> List[int]:
        indices: List[int] = []
        node = self.node
        while node is not None and node.parent is not None:
            indices[:0] = node.value
            node = node.parent
        return indices


# the handle type: this module's CacheHandle, or fast's (which holds tensors)
H = TypeVar("H")


class MatchResult(NamedTuple, Generic[H]):
    cuda_handle: H


class InsertResult(NamedTuple, Generic[H]):
    cached_len: int  # how much of the inserted prefix the cache already had
    handle: H  # the inserted prefix, page-aligned


class NaivePrefixCache:
    """Caches nothing: every match is empty, every insert keeps nothing."""

    def __init__(self, page_size: int = 1) -> None:
        self.page_size = page_size
        self._empty = CacheHandle(0)

    def match_prefix(self, input_ids: List[int]) -> MatchResult[CacheHandle]:
        return MatchResult(self._empty)

    def insert_prefix(self, input_ids: List[int], indices: List[int]) -> InsertResult[CacheHandle]:
        return InsertResult(0, self._empty)

    def lock_handle(self, handle: CacheHandle, unlock: bool = False) -> None:
        pass

    def evict(self, size: int) -> List[int]:
        if size > 0:
            raise RuntimeError(f"cannot evict {size} tokens: the naive cache holds none")
        return []

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(0, 0)

    def nodes(self) -> List[Any]:
        return []

    def check_integrity(self) -> None:
        pass
