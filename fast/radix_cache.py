"""The radix prefix cache over tensors, with eviction that never walks the whole tree.

Same semantics as `reference.radix_cache` (page-sized edges, lock counts on the path to the
root, LRU by a logical clock with ties broken by creation id). Node values are int32 tensors
that are copies, never views of the page table: a row is rewritten when its slot is reused.
Unlocked leaves are kept in a heap as they appear; an entry is stale once its node's `version`
moves on, and is dropped when popped, so evicting k leaves costs O(k log N).
"""

from __future__ import annotations

import heapq
from typing import Dict, List, Optional, Tuple

import torch

from .prefix_cache import CacheHandle, InsertResult, MatchResult, SizeInfo


class RadixNode:
    __slots__ = ("id", "key", "value", "parent", "children", "ref_count", "last_access", "version")

    def __init__(self, node_id: int, key: List[int], value: torch.Tensor, parent: Optional["RadixNode"]):
        self.id = node_id
        self.key = key
        self.value = value
        self.parent = parent
        self.children: Dict[Tuple[int, ...], RadixNode] = {}
        self.ref_count = 0
        self.last_access = 0
        self.version = 0

    @property
    def length(self) -> int:
        return len(self.key)

    def is_leaf(self) -> bool:
        return not self.children


def _common_prefix(key: List[int], ids: List[int], start: int) -> int:
    n = min(len(key), len(ids) - start)
    if key[:n] == ids[start : start + n]:
        return n
    i = 0
    while key[i] == ids[start + i]:
        i += 1
    return i


class RadixPrefixCache:
    def __init__(self, page_size: int = 1, device: torch.device | str = "cpu") -> None:
        self.page_size = page_size
        self.device = torch.device(device)
        self._next_id = 0
        self._num_nodes = 0
        self.clock = 0
        self.root = self._new_node([], torch.empty(0, dtype=torch.int32, device=self.device), None)
        self.evictable_size = 0
        self.protected_size = 0
        self._leaves: List[Tuple[int, int, int, RadixNode]] = []  # (last_access, id, version, node)
        self._empty = torch.empty(0, dtype=torch.int32, device=self.device)

    # -- tree structure -----------------------------------------------------------------------
    def _new_node(self, key: List[int], value: torch.Tensor, parent: Optional[RadixNode]) -> RadixNode:
        node = RadixNode(self._next_id, key, value, parent)
        self._next_id += 1
        self._num_nodes += 1
        node.last_access = self.clock
        if parent is not None:
            parent.children[tuple(key[: self.page_size])] = node
        return node

    def _changed(self, node: RadixNode) -> None:
        """Invalidate the node's heap entries; re-enter it if it is now an evictable leaf."""
        node.version += 1
        if node.parent is not None and node.ref_count == 0 and not node.children:
            heapq.heappush(self._leaves, (node.last_access, node.id, node.version, node))
            if len(self._leaves) > 4 * self._num_nodes + 64:  # drop stale entries, amortized O(1)
                self._leaves = [e for e in self._leaves if e[2] == e[3].version and e[3].parent is not None]
                heapq.heapify(self._leaves)

    def _split(self, node: RadixNode, pos: int) -> RadixNode:
        parent = node.parent
        assert parent is not None  # the root is never split
        del parent.children[tuple(node.key[: self.page_size])]
        head = self._new_node(node.key[:pos], node.value[:pos].clone(), parent)
        head.ref_count = node.ref_count
        head.last_access = node.last_access
        node.key, node.value, node.parent = node.key[pos:], node.value[pos:].clone(), head
        head.children[tuple(node.key[: self.page_size])] = node
        return head

    def _walk(self, ids: List[int]) -> Tuple[RadixNode, int]:
        self.clock += 1
        ps = self.page_size
        node, matched = self.root, 0
        while matched < len(ids):
            child = node.children.get(tuple(ids[matched : matched + ps]))
            if child is None:
                break
            common = _common_prefix(child.key, ids, matched)
            common -= common % ps
            if common < child.length:
                child = self._split(child, common)
            child.last_access = self.clock
            self._changed(child)
            node, matched = child, matched + common
            if common < child.length:
                break
        return node, matched

    # -- the prefix-cache interface -----------------------------------------------------------
    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult[CacheHandle]:
        node, matched = self._walk(input_ids.tolist())
        return MatchResult(CacheHandle(matched, node, self.device))

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult[CacheHandle]:
        length = len(input_ids) - len(input_ids) % self.page_size
        ids = input_ids[:length].tolist()
        node, matched = self._walk(ids)
        if matched < length:
            parent = node
            node = self._new_node(ids[matched:], indices[matched:length].to(torch.int32).clone(), parent)
            self.evictable_size += node.length
            self._changed(parent)
            self._changed(node)
        return InsertResult(matched, CacheHandle(length, node, self.device))

    def lock_handle(self, handle: CacheHandle, unlock: bool = False) -> None:
        node = handle.node
        while node is not None and node.parent is not None:
            if unlock:
                if node.ref_count <= 0:
                    raise RuntimeError(f"unlock of node {node.id} whose lock count is already 0")
                node.ref_count -= 1
                if node.ref_count == 0:
                    self.evictable_size += node.length
                    self.protected_size -= node.length
                    self._changed(node)
            else:
                if node.ref_count == 0:
                    self.evictable_size -= node.length
                    self.protected_size += node.length
                    node.version += 1
                node.ref_count += 1
            node = node.parent

    def evict(self, size: int) -> torch.Tensor:
        if size <= 0:
            return self._empty
        if size > self.evictable_size:
            raise RuntimeError(f"cannot evict {size} tokens: only {self.evictable_size} are evictable")
        evicted: List[torch.Tensor] = []
        freed = 0
        while freed < size:
            _, _, version, node = heapq.heappop(self._leaves)
            if version != node.version or node.parent is None:
                continue  # stale entry
            parent = node.parent
            del parent.children[tuple(node.key[: self.page_size])]
            node.parent = None
            node.version += 1
            self._num_nodes -= 1
            evicted.append(node.value)
            freed += node.length
            self.evictable_size -= node.length
            self._changed(parent)
        return torch.cat(evicted)

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(self.evictable_size, self.protected_size)

    def nodes(self) -> List[RadixNode]:
        """Every node but the root, parents before children, children in key order."""
        out: List[RadixNode] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                out.append(node)
            stack.extend(node.children[k] for k in sorted(node.children, reverse=True))
        return out

    def check_integrity(self) -> None:
        ps = self.page_size
        evictable = protected = 0
        live_leaves = set()
        for node in self.nodes():
            where = f"radix node {node.id}"
            if node.parent is None:
                raise RuntimeError(f"integrity: {where} has no parent")
            if node.length == 0 or node.length % ps or node.value.numel() != node.length:
                raise RuntimeError(
                    f"integrity: {where} has key length {node.length}, value length {node.value.numel()}"
                )
            if node.parent.children.get(tuple(node.key[:ps])) is not node:
                raise RuntimeError(f"integrity: {where} is not its parent's child under its first page")
            if node.value.device != self.device or node.value.dtype != torch.int32:
                raise RuntimeError(f"integrity: {where} value is {node.value.dtype} on {node.value.device}")
            below = sum(c.ref_count for c in node.children.values())
            if node.ref_count < below:
                raise RuntimeError(f"integrity: {where} lock count {node.ref_count} < its children's {below}")
            if node.ref_count:
                protected += node.length
            else:
                evictable += node.length
                if node.is_leaf():
                    live_leaves.add(node.id)
        if (evictable, protected) != (self.evictable_size, self.protected_size):
            raise RuntimeError(
                f"integrity: radix sizes recount to evictable={evictable} protected={protected}, "
                f"recorded {self.evictable_size} {self.protected_size}"
            )
        in_heap = {n.id for _, _, v, n in self._leaves if v == n.version and n.parent is not None}
        if in_heap != live_leaves:
            raise RuntimeError(
                f"integrity: evictable-leaf heap holds {sorted(in_heap)}, tree has {sorted(live_leaves)}"
            )
