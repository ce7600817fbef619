"""The bug zoo: realistic cache-manager bugs, each a small runtime patch of one `fast` method.

The product code carries no bug switches: `patched(name)` swaps one method of a `fast` class
for a buggy version for the duration of a `with` block (in this process only). `reference` is
never patched, so the lockstep harness sees fast diverge from the model.

Each buggy method is a copy of the current `fast` method with one realistic edit, marked
`# BUG:`. `origin` names the project whose history had a bug of that kind (or "ours").
`kvledger zoo` (properties/zoo_run.py) measures which property run catches each one.
"""

from __future__ import annotations

import heapq
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Tuple

import torch

from kvledger import fast
from kvledger.fast.prefix_cache import CacheHandle, InsertResult, MatchResult
from kvledger.fast.radix_cache import RadixPrefixCache, _common_prefix
from kvledger.fast.requests import ChunkedReq, Req
from kvledger.reference.pages import div_ceil


@dataclass(frozen=True)
class Bug:
    name: str
    origin: str  # where such a bug was seen (project / issue), or "ours"
    description: str
    patches: Callable[[], List[Tuple[type, str, object]]]  # (class, attribute, buggy value)


BUGS: Dict[str, Bug] = {}


def bug(name: str, origin: str, description: str):
    def register(fn: Callable[[], List[Tuple[type, str, object]]]):
        BUGS[name] = Bug(name, origin, description, fn)
        return fn
    return register


@contextmanager
def patched(name: str | None) -> Iterator[None]:
    """Apply bug `name` (None: no bug) to the fast classes inside the block."""
    if name is None:
        yield
        return
    if name not in BUGS:
        raise KeyError(f"unknown bug {name!r}; known: {', '.join(sorted(BUGS))}")
    saved = []
    try:
        for cls, attr, value in BUGS[name].patches():
            saved.append((cls, attr, cls.__dict__.get(attr, _MISSING)))
            setattr(cls, attr, value)
        yield
    finally:
        for cls, attr, old in reversed(saved):
            if old is _MISSING:
                delattr(cls, attr)
            else:
                setattr(cls, attr, old)


_MISSING = object()


# -- cache_req: the four regions ---------------------------------------------------------------

@bug("no-remap-on-duplicate", "kvledger seed review (SGLang remaps req_to_token)",
     "cache_req frees duplicate prefix pages but leaves the running request's row pointing at them")
def _no_remap():
    def cache_req(self, req, *, finished):
        row = self.page_table[req.table_idx]
        locs = row[: req.cached_len]
        old = req.cache_handle
        hit, new = self.prefix_cache.insert_prefix(req.input_ids[: req.cached_len], locs)
        self.unlock(old)
        self._free(locs[old.cached_len : hit])
        if finished:
            self._free(locs[new.cached_len :])
            return
        # BUG: the remap of row[old.cached_len:hit] to the cache's copy is missing
        req.cache_handle = new
        self.lock(new)
    return [(fast.CacheManager, "cache_req", cache_req)]


@bug("double-free-on-finish", "SGLang (double free of KV on abort/finish)",
     "cache_req(finished=True) frees the tail from the old handle's end: the duplicate region twice "
     "and the just-inserted prefix too")
def _double_free_on_finish():
    def cache_req(self, req, *, finished):
        row = self.page_table[req.table_idx]
        locs = row[: req.cached_len]
        old = req.cache_handle
        hit, new = self.prefix_cache.insert_prefix(req.input_ids[: req.cached_len], locs)
        self.unlock(old)
        self._free(locs[old.cached_len : hit])
        if finished:
            self._free(locs[old.cached_len :])  # BUG: should start at new.cached_len
            return
        if hit > old.cached_len:
            row[old.cached_len : hit] = new.get_matched_indices()[old.cached_len : hit]
        req.cache_handle = new
        self.lock(new)
    return [(fast.CacheManager, "cache_req", cache_req)]


@bug("frees-locked-prefix", "SGLang (abort frees the prefix shared with the radix cache)",
     "cache_req frees [0, hit) instead of [old, hit): pages of the prefix the cache still holds go free")
def _frees_locked_prefix():
    def cache_req(self, req, *, finished):
        row = self.page_table[req.table_idx]
        locs = row[: req.cached_len]
        old = req.cache_handle
        hit, new = self.prefix_cache.insert_prefix(req.input_ids[: req.cached_len], locs)
        self.unlock(old)
        self._free(locs[:hit])  # BUG: should be locs[old.cached_len : hit]
        if finished:
            self._free(locs[new.cached_len :])
            return
        if hit > old.cached_len:
            row[old.cached_len : hit] = new.get_matched_indices()[old.cached_len : hit]
        req.cache_handle = new
        self.lock(new)
    return [(fast.CacheManager, "cache_req", cache_req)]


@bug("unlock-wrong-handle", "ours (mini-sglang cache_req unlocks old, locks new)",
     "cache_req unlocks the handle it just inserted instead of the one the request held")
def _unlock_wrong_handle():
    def cache_req(self, req, *, finished):
        row = self.page_table[req.table_idx]
        locs = row[: req.cached_len]
        old = req.cache_handle
        hit, new = self.prefix_cache.insert_prefix(req.input_ids[: req.cached_len], locs)
        self.unlock(new)  # BUG: should unlock old
        self._free(locs[old.cached_len : hit])
        if finished:
            self._free(locs[new.cached_len :])
            return
        if hit > old.cached_len:
            row[old.cached_len : hit] = new.get_matched_indices()[old.cached_len : hit]
        req.cache_handle = new
        self.lock(new)
    return [(fast.CacheManager, "cache_req", cache_req)]


# -- freeing and allocation --------------------------------------------------------------------

@bug("lazy-free-holds-views", "mini-sglang seed (lazy_free_region keeps indices[::page_size])",
     "_free keeps a view of the page-table row; a row remapped before the lazy region ends frees "
     "the wrong pages")
def _lazy_free_views():
    def _free(self, indices):
        starts = indices[:: self.page_size]  # BUG: no .clone()
        if self._lazy is not None:
            self._lazy.append(starts)
        elif len(starts):
            self.free_slots = torch.cat([self.free_slots, starts])
    return [(fast.CacheManager, "_free", _free)]


@bug("evict-counts-pages", "mini-sglang / SGLang paged allocator (evict(num_pages) vs tokens)",
     "_allocate asks the prefix cache to evict the page shortfall as if it were tokens")
def _evict_counts_pages():
    def _allocate(self, needed_pages):
        free = len(self.free_slots)
        if needed_pages > free:
            evicted = self.prefix_cache.evict(needed_pages - free)  # BUG: size is in tokens
            self.free_slots = torch.cat([self.free_slots, evicted[:: self.page_size]])
        if needed_pages > len(self.free_slots):
            raise RuntimeError(f"out of pages: need {needed_pages}, have {len(self.free_slots)} after eviction")
        allocated = self.free_slots[:needed_pages]
        self.free_slots = self.free_slots[needed_pages:]
        return allocated
    return [(fast.CacheManager, "_allocate", _allocate)]


@bug("free-list-lifo", "ours (vLLM's free block queue is FIFO for prefix reuse)",
     "_allocate hands out the most recently freed pages first (pops the back of free_slots)")
def _free_list_lifo():
    def _allocate(self, needed_pages):
        free = len(self.free_slots)
        if needed_pages > free:
            evicted = self.prefix_cache.evict((needed_pages - free) * self.page_size)
            self.free_slots = torch.cat([self.free_slots, evicted[:: self.page_size]])
        if needed_pages > len(self.free_slots):
            raise RuntimeError(f"out of pages: need {needed_pages}, have {len(self.free_slots)} after eviction")
        keep = len(self.free_slots) - needed_pages
        allocated = self.free_slots[keep:]  # BUG: the back, not the front
        self.free_slots = self.free_slots[:keep]
        return allocated
    return [(fast.CacheManager, "_allocate", _allocate)]


@bug("allocate-floor-pages", "ours (nano-vllm / vLLM block-count off-by-one at a page boundary)",
     "allocate_paged rounds device_len down to a page: the partial last page is never allocated")
def _allocate_floor():
    def allocate_paged(self, reqs):
        ps = self.page_size
        rows, cols = [], []
        for req in reqs:
            lo, hi = div_ceil(req.cached_len, ps) * ps, req.device_len // ps * ps  # BUG: floor
            if hi > lo:
                rows += [req.table_idx] * (hi - lo)
                cols += range(lo, hi)
        if not rows:
            return
        locs = self._page_to_token(self._allocate(len(rows) // ps))
        index = torch.tensor([rows, cols], dtype=torch.int64, pin_memory=self._pin)
        index = index.to(self.device, non_blocking=True)
        self.page_table[index[0], index[1]] = locs
    return [(fast.CacheManager, "allocate_paged", allocate_paged)]


@bug("match-whole-prompt", "nano-vllm / vLLM (full prompt cache hit leaves no token to compute)",
     "match_req matches the whole prompt, so cached_len can reach input_len and nothing is computed")
def _match_whole_prompt():
    def match_req(self, req):
        return self.prefix_cache.match_prefix(req.input_ids[: req.input_len])  # BUG: not input_len - 1
    return [(fast.CacheManager, "match_req", match_req)]


@bug("available-ignores-evictable", "mini-sglang seed (available_size must count evictable)",
     "available_size counts only free pages, so admission rejects requests the cache could make room for")
def _available_ignores_evictable():
    def available_size(self):
        return len(self.free_slots) * self.page_size  # BUG: + evictable_size is missing
    return [(fast.CacheManager, "available_size", property(available_size))]


# -- admission ---------------------------------------------------------------------------------

@bug("reservation-in-tokens", "mini-sglang seed (worst-case reservation in tokens)",
     "PrefillAdder reserves input_len - cached_len + max_tokens tokens, not whole pages")
def _reservation_in_tokens():
    def _need(self, cached_len, req):
        return req.input_len - cached_len + req.output_len  # BUG: no page rounding
    return [(fast.PrefillAdder, "_need", _need)]


@bug("inflight-in-tokens", "mini-sglang seed (running reservation as remain_len)",
     "DecodeManager.inflight_tokens sums the running requests' remain_len, not their remaining pages")
def _inflight_in_tokens():
    def inflight_tokens(self):
        return sum(r.remain_len for r in self.running_reqs.values())  # BUG: tokens, not pages
    return [(fast.DecodeManager, "inflight_tokens", property(inflight_tokens))]


@bug("no-recheck-after-lock", "mini-sglang seed (the second check after lock)",
     "_try_allocate_one skips the admission check after locking the hit, which stopped being evictable")
def _no_recheck():
    def _try_allocate_one(self, req):
        if self.table_manager.available_size == 0:
            return None
        cm = self.cache_manager
        handle = cm.match_req(req).cuda_handle
        need = self._need(handle.cached_len, req)
        if need + self.reserved_size > cm.available_size:
            return None
        cm.lock(handle)
        # BUG: the recheck after locking is gone
        table_idx = self.table_manager.allocate()
        n = handle.cached_len
        if n > 0:
            self.table_manager.token_pool[table_idx, :n].copy_(req.input_ids[:n], non_blocking=True)
            self.table_manager.page_table[table_idx, :n].copy_(handle.get_matched_indices())
        return handle, table_idx
    return [(fast.PrefillAdder, "_try_allocate_one", _try_allocate_one)]


@bug("budget-charges-cached-prefix", "SGLang (PrefillAdder charging input_len, not extend_len)",
     "_add_one_req charges the token budget for the cached prefix too, so fewer requests prefill together")
def _budget_charges_cached():
    def _add_one_req(self, pending, handle, table_idx, cached_len):
        chunk = min(self.token_budget, pending.input_len - cached_len)
        end = cached_len + chunk
        self.token_budget -= end  # BUG: should be chunk (the cached prefix is not computed)
        self.reserved_size += self._need(cached_len, pending)
        self.table_manager.token_pool[table_idx, cached_len:end].copy_(
            pending.input_ids[cached_len:end], non_blocking=True)
        cls = ChunkedReq if end < pending.input_len else Req
        return cls(pending.input_ids[:end], table_idx, cached_len, pending.output_len,
                   pending.uid, pending.sampling_params, handle)
    return [(fast.PrefillAdder, "_add_one_req", _add_one_req)]


@bug("table-slot-leak", "ours (SGLang req_to_token_pool slot leak on abort)",
     "TableManager.free marks the slot free but never returns it to the free list")
def _table_slot_leak():
    def free(self, table_idx):
        if self._is_free[table_idx]:
            raise RuntimeError(f"table slot {table_idx} freed twice")
        self._is_free[table_idx] = True
        # BUG: self._free_slots.append(table_idx) is missing
    return [(fast.TableManager, "free", free)]


# -- the radix tree ----------------------------------------------------------------------------

@bug("lock-skips-own-node", "mini-sglang / SGLang (inc_lock_ref starting at the parent)",
     "lock_handle walks from the handle's parent, so the matched node itself stays unlocked and evictable")
def _lock_skips_own_node():
    def lock_handle(self, handle, unlock=False):
        node = handle.node.parent if handle.node is not None else None  # BUG: should start at handle.node
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
    return [(RadixPrefixCache, "lock_handle", lock_handle)]


@bug("unlock-skips-evictable-size", "SGLang (evictable_size_ drift in dec_lock_ref)",
     "unlocking a node to lock count 0 moves it out of protected_size but never into evictable_size")
def _unlock_skips_evictable():
    def lock_handle(self, handle, unlock=False):
        node = handle.node
        while node is not None and node.parent is not None:
            if unlock:
                if node.ref_count <= 0:
                    raise RuntimeError(f"unlock of node {node.id} whose lock count is already 0")
                node.ref_count -= 1
                if node.ref_count == 0:
                    # BUG: self.evictable_size += node.length is missing
                    self.protected_size -= node.length
                    self._changed(node)
            else:
                if node.ref_count == 0:
                    self.evictable_size -= node.length
                    self.protected_size += node.length
                    node.version += 1
                node.ref_count += 1
            node = node.parent
    return [(RadixPrefixCache, "lock_handle", lock_handle)]


@bug("lock-keeps-heap-entry", "ours (lazy-deletion heap of evictable leaves)",
     "locking a node does not invalidate its heap entry, so eviction can take a locked leaf")
def _lock_keeps_heap_entry():
    def lock_handle(self, handle, unlock=False):
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
                    # BUG: node.version += 1 is missing
                node.ref_count += 1
            node = node.parent
    return [(RadixPrefixCache, "lock_handle", lock_handle)]


@bug("match-returns-root", "SGLang (match_prefix returning the root with a non-zero prefix length)",
     "match_prefix reports the matched length but hands back the root node, so the handle has no path")
def _match_returns_root():
    def match_prefix(self, input_ids):
        node, matched = self._walk(input_ids.tolist())
        return MatchResult(CacheHandle(matched, self.root, self.device))  # BUG: should be node
    return [(RadixPrefixCache, "match_prefix", match_prefix)]


@bug("insert-stores-view", "SGLang (radix values as views of req_to_token)",
     "insert_prefix stores a view of the page-table row, which changes when the row is reused")
def _insert_stores_view():
    def insert_prefix(self, input_ids, indices):
        length = len(input_ids) - len(input_ids) % self.page_size
        ids = input_ids[:length].tolist()
        node, matched = self._walk(ids)
        if matched < length:
            parent = node
            node = self._new_node(ids[matched:], indices[matched:length].to(torch.int32), parent)  # BUG: no clone
            self.evictable_size += node.length
            self._changed(parent)
            self._changed(node)
        return InsertResult(matched, CacheHandle(length, node, self.device))
    return [(RadixPrefixCache, "insert_prefix", insert_prefix)]


@bug("insert-unaligned", "SGLang paged radix cache (inserting a partial last page)",
     "insert_prefix keeps the whole key instead of cutting it to whole pages")
def _insert_unaligned():
    def insert_prefix(self, input_ids, indices):
        length = len(input_ids)  # BUG: should drop len(input_ids) % page_size
        ids = input_ids[:length].tolist()
        node, matched = self._walk(ids)
        if matched < length:
            parent = node
            node = self._new_node(ids[matched:], indices[matched:length].to(torch.int32).clone(), parent)
            self.evictable_size += node.length
            self._changed(parent)
            self._changed(node)
        return InsertResult(matched, CacheHandle(length, node, self.device))
    return [(RadixPrefixCache, "insert_prefix", insert_prefix)]


@bug("split-unaligned", "SGLang paged radix cache (key match not rounded to page_size)",
     "_walk splits a node where the tokens stop matching, not at the last whole page")
def _split_unaligned():
    def _walk(self, ids):
        self.clock += 1
        ps = self.page_size
        node, matched = self.root, 0
        while matched < len(ids):
            child = node.children.get(tuple(ids[matched : matched + ps]))
            if child is None:
                break
            common = _common_prefix(child.key, ids, matched)
            # BUG: common -= common % ps is missing
            if common < child.length:
                child = self._split(child, common)
            child.last_access = self.clock
            self._changed(child)
            node, matched = child, matched + common
            if common < child.length:
                break
        return node, matched
    return [(RadixPrefixCache, "_walk", _walk)]


@bug("split-drops-ref-count", "SGLang (_split_node copying lock_ref)",
     "_split gives the new head node lock count 0 although the locked tail now hangs below it")
def _split_drops_ref_count():
    def _split(self, node, pos):
        parent = node.parent
        del parent.children[tuple(node.key[: self.page_size])]
        head = self._new_node(node.key[:pos], node.value[:pos].clone(), parent)
        # BUG: head.ref_count = node.ref_count is missing
        head.last_access = node.last_access
        node.key, node.value, node.parent = node.key[pos:], node.value[pos:].clone(), head
        head.children[tuple(node.key[: self.page_size])] = node
        return head
    return [(RadixPrefixCache, "_split", _split)]


@bug("lru-not-touched-on-match", "SGLang / vLLM (last_access not refreshed on a prefix hit)",
     "_walk does not stamp the nodes it matches, so a hot prefix is evicted as if never reused")
def _lru_not_touched():
    def _walk(self, ids):
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
            # BUG: child.last_access = self.clock is missing
            self._changed(child)
            node, matched = child, matched + common
            if common < child.length:
                break
        return node, matched
    return [(RadixPrefixCache, "_walk", _walk)]


@bug("lru-evicts-mru", "ours (heap key sign flip; vLLM evictor ordering bugs)",
     "the evictable-leaf heap is keyed on -last_access: the most recently used leaf goes first")
def _lru_evicts_mru():
    def _changed(self, node):
        node.version += 1
        if node.parent is not None and node.ref_count == 0 and not node.children:
            heapq.heappush(self._leaves, (-node.last_access, node.id, node.version, node))  # BUG: sign
            if len(self._leaves) > 4 * self._num_nodes + 64:
                self._leaves = [e for e in self._leaves if e[2] == e[3].version and e[3].parent is not None]
                heapq.heapify(self._leaves)
    return [(RadixPrefixCache, "_changed", _changed)]
