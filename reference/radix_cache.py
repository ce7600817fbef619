"""The radix prefix cache as a plain trie: the spec the tensor version is held to.

Keys are token ids, split into page-sized edges; a node's value is the token locations of its
key. A node's `ref_count` is the number of locked handles at or below it. Only unlocked leaves
can be evicted, least recently used first: `last_access` is a logical clock ticked once per tree
walk, ties broken by the node's creation id, so eviction order is fully determined.
Eviction here scans every leaf each time: slow, and obviously right.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .events import note
from .pages import align_down
from .prefix_cache import CacheHandle, InsertResult, MatchResult, SizeInfo


class RadixNode:
    def __init__(self, node_id: int, key: List[int], value: List[int], parent: Optional["RadixNode"]):
        self.id = node_id
        self.key = key
        self.value = value
        self.parent = parent
        self.children: Dict[Tuple[int, ...], RadixNode] = {}
        self.ref_count = 0
        self.last_access = 0

    @property
    def length(self) -> int:
        return len(self.key)

    def is_leaf(self) -> bool:
        return not self.children


class RadixPrefixCache:
    def __init__(self, page_size: int = 1) -> None:
        self.page_size = page_size
        self._next_id = 0
        self.clock = 0
        self.root = self._new_node([], [], None)
        self.evictable_size = 0
        self.protected_size = 0

    def _new_node(self, key: List[int], value: List[int], parent: Optional[RadixNode]) -> RadixNode:
        node = RadixNode(self._next_id, key, value, parent)
        self._next_id += 1
        node.last_access = self.clock
        if parent is not None:
            parent.children[self._edge(key)] = node
        return node

    def _edge(self, ids: List[int]) -> Tuple[int, ...]:
        return tuple(ids[: self.page_size])

    def _split(self, node: RadixNode, pos: int) -> RadixNode:
        """Cut `node` at `pos`: a new parent takes the first `pos` tokens and the lock count."""
        parent = node.parent
        assert parent is not None and 0 < pos < node.length
        note("radix: node split")
        del parent.children[self._edge(node.key)]
        head = self._new_node(node.key[:pos], node.value[:pos], parent)
        head.ref_count = node.ref_count
        head.last_access = node.last_access
        node.key, node.value, node.parent = node.key[pos:], node.value[pos:], head
        head.children[self._edge(node.key)] = node
        return head

    def _walk(self, ids: List[int]) -> Tuple[RadixNode, int]:
        """Follow whole pages of `ids`; split a node matched part-way. Touches the path."""
        self.clock += 1
        node, matched = self.root, 0
        while matched < len(ids):
            child = node.children.get(self._edge(ids[matched:]))
            if child is None:
                break
            common = 0
            limit = min(child.length, len(ids) - matched)
            while common < limit and child.key[common] == ids[matched + common]:
                common += 1
            common = align_down(common, self.page_size)
            if common < child.length:
                child = self._split(child, common)
            child.last_access = self.clock
            node, matched = child, matched + common
            if common < child.length:
                break
        return node, matched

    def match_prefix(self, input_ids: List[int]) -> MatchResult[CacheHandle]:
        node, matched = self._walk(list(input_ids))
        return MatchResult(CacheHandle(matched, node))

    def insert_prefix(self, input_ids: List[int], indices: List[int]) -> InsertResult[CacheHandle]:
        length = align_down(len(input_ids), self.page_size)
        ids, locs = list(input_ids[:length]), list(indices[:length])
        node, matched = self._walk(ids)
        if matched < length:
            node = self._new_node(ids[matched:], locs[matched:], node)
            self.evictable_size += node.length
        return InsertResult(matched, CacheHandle(length, node))

    def lock_handle(self, handle: CacheHandle, unlock: bool = False) -> None:
        node = handle.node
        while node is not None and node.parent is not None:
            if unlock:
                if node.ref_count <= 0:
                    raise RuntimeError(f"unlock of node {node.id} whose lock count is already 0")
                node.ref_count -= 1
                if node.ref_count == 0:
                    if node.is_leaf():
                        note("radix: lock/unlock of an evictable leaf")
                    self.evictable_size += node.length
                    self.protected_size -= node.length
            else:
                if node.ref_count == 0:
                    if node.is_leaf():
                        note("radix: lock/unlock of an evictable leaf")
                    self.evictable_size -= node.length
                    self.protected_size += node.length
                node.ref_count += 1
            node = node.parent

    def evict(self, size: int) -> List[int]:
        """Free at least `size` tokens, whole leaves, least recently used first."""
        if size > self.evictable_size:
            raise RuntimeError(f"cannot evict {size} tokens: only {self.evictable_size} are evictable")
        evicted: List[int] = []
        while len(evicted) < size:
            leaves = [n for n in self.nodes() if n.is_leaf() and n.ref_count == 0]
            victim = min(leaves, key=lambda n: (n.last_access, n.id))
            if evicted:
                note("radix: one eviction takes several leaves")
            assert victim.parent is not None  # a leaf, never the root
            if victim.parent is not self.root and len(victim.parent.children) == 1 and victim.parent.ref_count == 0:
                note("radix: eviction makes the parent an evictable leaf")
            del victim.parent.children[self._edge(victim.key)]
            evicted += victim.value
            self.evictable_size -= victim.length
        return evicted

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
        evictable = protected = 0
        for node in self.nodes():
            where = f"radix node {node.id}"
            if node.parent is None:
                raise RuntimeError(f"integrity: {where} has no parent")
            if node.length == 0 or node.length % self.page_size or len(node.value) != node.length:
                raise RuntimeError(f"integrity: {where} has key length {node.length}, value length {len(node.value)}")
            if node.parent.children.get(self._edge(node.key)) is not node:
                raise RuntimeError(f"integrity: {where} is not its parent's child under its first page")
            below = sum(c.ref_count for c in node.children.values())
            if node.ref_count < below:
                raise RuntimeError(f"integrity: {where} lock count {node.ref_count} < its children's {below}")
            if node.ref_count:
                protected += node.length
            else:
                evictable += node.length
        if (evictable, protected) != (self.evictable_size, self.protected_size):
            raise RuntimeError(
                f"integrity: radix sizes recount to evictable={evictable} protected={protected}, "
                f"recorded {self.evictable_size} {self.protected_size}"
            )
