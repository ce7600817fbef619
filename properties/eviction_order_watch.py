"""`EvictionOrderWatch`: the radix cache's eviction-order events of the lockstep machine."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Set, Tuple

from kvledger.reference.prefix_cache import CacheHandle, InsertResult
from kvledger.reference.radix_cache import RadixNode, RadixPrefixCache


class EvictionOrderWatch:
    """Two states of the reference tree that only an eviction order can show, noted as events.

    fast keeps its evictable leaves in a heap whose entries carry the key (last_access, id) they
    had when pushed; each change of a leaf must push it again (`_changed`). The reference has no
    heap, so this wraps its radix cache (this instance only; nothing of its behaviour changes) and
    notes, at each eviction, whether a heap that missed one kind of refresh would order it wrong:

    - a walk stamped an evictable leaf (an admission that matched it and was turned away before
      locking it, or a finished request's insert over a duplicate), no lock has covered it since,
      and its old stamp would order it before another evictable leaf its new stamp comes after;
    - an evictable leaf gained a child on insert and nothing touched or locked it since, so a heap
      that kept its entry would hold a node that is no longer a leaf.
    """

    def __init__(self, cache: RadixPrefixCache, note: Callable[[str], None]) -> None:
        self.cache, self.note = cache, note
        self.retouched: Dict[RadixNode, int] = {}  # evictable leaf -> its stamp before the first re-touch
        self.gained: Dict[RadixNode, int] = {}  # leaf that gained a child -> its stamp then
        # (end node of the last walk, whether it was an evictable leaf)
        self._walked: Optional[Tuple[RadixNode, bool]] = None
        walk, insert, lock, evict = cache._walk, cache.insert_prefix, cache.lock_handle, cache.evict

        def watched_walk(ids: List[int]) -> Tuple[RadixNode, int]:
            stamps = {n: n.last_access for n in self._evictable_leaves()}
            node, matched = walk(ids)
            self._walked = (node, node in stamps)
            if node in stamps and node.last_access != stamps[node]:
                self.retouched.setdefault(node, stamps[node])
            return node, matched

        def watched_insert(input_ids: List[int], indices: List[int]) -> InsertResult[CacheHandle]:
            result = insert(input_ids, indices)
            assert self._walked is not None  # an insert walks the tree first
            node, was_leaf = self._walked
            if was_leaf and node.children:
                self.gained[node] = node.last_access
            return result

        def watched_lock(handle: CacheHandle, unlock: bool = False) -> None:
            node = handle.node
            while node is not None and node.parent is not None:  # a lock or unlock re-keys the path
                self.retouched.pop(node, None)
                self.gained.pop(node, None)
                node = node.parent
            return lock(handle, unlock)

        def watched_evict(size: int) -> List[int]:
            self._before_eviction()
            return evict(size)

        # this instance only: the class's methods stay as they are
        cache._walk, cache.insert_prefix, cache.lock_handle, cache.evict = (  # type: ignore[method-assign]
            watched_walk,
            watched_insert,
            watched_lock,
            watched_evict,
        )

    def _in_tree(self, node: RadixNode) -> bool:
        return node.parent is not None and node.parent.children.get(self.cache._edge(node.key)) is node

    def _evictable_leaves(self) -> Set[RadixNode]:
        return {n for n in self.cache.nodes() if n.ref_count == 0 and n.is_leaf()}

    def _before_eviction(self) -> None:
        leaves = self._evictable_leaves()
        self.retouched = {n: t for n, t in self.retouched.items() if n in leaves}
        if any(
            (t, n.id) < (m.last_access, m.id) < (n.last_access, n.id) for n, t in self.retouched.items() for m in leaves
        ):
            self.note("radix: eviction after a cached leaf was re-touched")
        self.gained = {n: t for n, t in self.gained.items() if self._in_tree(n) and n.children and n.last_access == t}
        if self.gained:
            self.note("radix: eviction after a leaf gained a child")
