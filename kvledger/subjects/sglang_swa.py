"""`sglang:swa`: SGLang 0.5.23's default tree cache with its sliding-window option, as a kvledger
subject: a `UnifiedRadixCache` with tree components (FULL, SWA) over an `SWAKVPool` and its
`SWATokenToKVPoolAllocator` (`mem_cache/allocator/swa.py:48`), the tree the scheduler builds for a
model with sliding-window layers (`mem_cache/registry.py:create_unified_radix_cache`,
`tree_components = (FULL, SWA)`, `CacheInitParams.sliding_window_size` = the model's window W).

Everything runs as the `sglang` subject runs it (`sglang.py`, the same calls in the scheduler's
order); what the window adds, all inside SGLang:
- two pools: the allocator hands out a full-attention slot and an SWA slot for each position
  (`alloc_extend` / `alloc_decode` on both sub-allocators) and keeps the pair in
  `full_to_swa_index_mapping`; the request's row (`req_to_token`) holds the full slots, and the
  SWA slot of a position is the mapping's entry for its full slot (0: none);
- a request frees the SWA slots that left the window: before each allocation
  (`alloc_for_extend` / `alloc_for_decode` -> `ScheduleBatch.maybe_evict_swa`,
  schedule_batch.py:4068, for a decode once `seqlen - 1 - W >= component_evicted_seqlens[SWA] +
  SGLANG_SWA_EVICTION_INTERVAL`) and when it is checkpointed into the tree
  (`UnifiedRadixCache.checkpoint_into_tree`, unified_radix_cache.py:1164 ->
  `SWAComponent.free_out_of_window_slots` -> `common.free_swa_out_of_window_slots`, common.py:75):
  positions [max(cache_protected_len, swa_evict_floor), pre_len - ceil_page(max(W, page))) lose
  their SWA slot (`free_swa_segment`, the mapping cleared), and `component_evicted_seqlens[SWA]`
  records how far;
- the tree keeps an SWA value per node beside the full one (the SWA slots, or None once evicted:
  a tombstone), locks only the nodes a window still reads (`SWAComponent.acquire_component_lock`),
  and a prefix hit must end on W live SWA positions (`SWAComponent.create_match_validator`);
- eviction frees either pool's slots (`evict_to_free_tokens`: the full shortfall and the SWA one).

The View: `requests` is the full-attention row; `groups` = [the SWA row: each position's SWA slot,
None where the mapping is cleared (dropped)]. The SWA pool is a pool of its own
(`Capabilities.group_pools`): its page q is shown as page q + num_pages + 1 (location + (num_pages + 1)
* page_size), so the two pools' pages never share a number; `GroupView.free` is its free list,
`GroupView.counters` its counters. Each tree node is an entry of group 0 (its full slots, with the
FULL lock) and, while its SWA value lives, an entry of group 1 (its SWA slots, lock None: SGLang's SWA
lock counts the requests whose window reaches the node, not those whose rows hold it).

The settings are SGLang's own: the window W = 2 * page_size (`sliding_window_size`), an SWA pool as
large as the full one (`--swa-full-tokens-ratio 1.0`), SGLANG_SWA_EVICTION_INTERVAL = the page
size (default 128, so that small pools reach a decode that frees SWA slots: a server setting, set
only while this subject runs SGLang's code), and SGLANG_INIT_NEW_TOKEN_RATIO 0.05 (default 0.7), so
that admission leaves a small pool to fill in decode: a decode that needs a page on an exhausted
pool, answered as `sglang:paged` answers it: check_decode_mem, then retract_decode in its own
order (`PagedSglangSubject`), over both pools.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Any, Dict, Iterator, List, Sequence, Tuple, cast

from kvledger.properties.subject import CachedEntry, Capabilities, GroupView, SubjectConfig, View
from kvledger.subjects.edits import SourceEdit
from kvledger.subjects.sglang import SglangSubject, load, probe, read_view
from kvledger.subjects.sglang_paged import PagedSglangSubject
from kvledger.subjects.sglang_scheduler import SchedulerState
from kvledger.subjects.sglang_swa_zoo import SWA_ZOO

__all__ = ["NAME", "ZOO", "SglangSwaSubject", "build", "probe"]

NAME = "sglang:swa"
ZOO: Tuple[SourceEdit, ...] = SWA_ZOO
WINDOW_PAGES = 2  # the sliding window, in pages: W = 2 * page_size
MIN_PAGE_SIZE = 2  # SWATokenToKVPoolAllocator's paged path (alloc_extend / alloc_decode assert page_size > 1)
# SGLANG_INIT_NEW_TOKEN_RATIO: the PrefillAdder charges running requests this share of their
# remaining decode tokens (SGLang's default 0.7), as a deployment that trusts requests to stop early
INIT_NEW_TOKEN_RATIO = 0.05
SWA = 1  # ComponentType.SWA: the index of a UnifiedTreeNode's SWA component data; the view's KV group 1


def build(config: SubjectConfig, path: str | None = None, edits: Sequence[SourceEdit] = ()) -> "SglangSwaSubject":
    if path:
        raise ValueError(f"{NAME} takes no path")
    return SglangSwaSubject(config, load(), edits)


class SglangSwaSubject(PagedSglangSubject):
    """`PagedSglangSubject` (the decode memory check and retract_decode) over SGLang's SWA pools and
    a (FULL, SWA) UnifiedRadixCache."""

    name = NAME

    def __init__(self, config: SubjectConfig, s: Any, edits: Sequence[SourceEdit] = ()) -> None:
        self.window = WINDOW_PAGES * config.page_size
        self.swa_pages = config.num_pages  # --swa-full-tokens-ratio 1.0
        super().__init__(config, s, edits)

    # -- what is built -----------------------------------------------------------------------------
    def build_allocator(self, config: SubjectConfig) -> Any:
        # ModelRunner's pools for a hybrid SWA model: SWAKVPool (swa_memory_pool.py:29) with one
        # sliding-window layer and one full one, and its allocator (allocator/swa.py:48)
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        ps, torch = config.page_size, self.s.torch
        size, size_swa = config.num_pages * ps, self.swa_pages * ps
        pool = SWAKVPool(
            size=size,
            size_swa=size_swa,
            page_size=ps,
            dtype=torch.bfloat16,
            head_num=1,
            head_dim=8,
            swa_attention_layer_ids=[0],
            full_attention_layer_ids=[1],
            device="cpu",
        )
        return SWATokenToKVPoolAllocator(size, size_swa, ps, torch.bfloat16, "cpu", pool, False)

    def tree_components(self) -> Tuple[Any, ...]:
        return (self.s.ComponentType.FULL, self.s.ComponentType.SWA)

    def cache_init_params(self, config: SubjectConfig) -> Any:
        params = super().cache_init_params(config)
        params.sliding_window_size = self.window
        return params

    def build_scheduler_state(self) -> SchedulerState:
        # NewTokenRatioTracker.from_config reads SGLANG_INIT_NEW_TOKEN_RATIO at the scheduler's start
        # (this deployment's knobs, not sglang:paged's)
        with self.s.envs.SGLANG_INIT_NEW_TOKEN_RATIO.override(INIT_NEW_TOKEN_RATIO):
            return SglangSubject.build_scheduler_state(self)

    def build_capabilities(self, config: SubjectConfig) -> Capabilities:
        first = config.num_pages + 1  # where the SWA pool's page 0 is shown, past the full pool
        pool = tuple(range(first + 1, first + 1 + self.swa_pages))
        return dataclasses.replace(super().build_capabilities(config), group_pools=(pool,))

    def batch_of(self, reqs: Sequence[Any]) -> Any:
        # prepare_for_extend / prepare_for_decode set the batch's forward mode before they allocate;
        # maybe_evict_swa reads it
        batch = super().batch_of(reqs)
        mode = self.s.schedule_batch.ForwardMode
        batch.forward_mode = mode.DECODE if self.scheduler.step == "decode" else mode.EXTEND
        return batch

    def _available_and_evictable(self) -> int:
        # the room both pools can make (evict_to_free_tokens evicts for each pool's shortfall)
        a, tree = self.allocator, self.tree
        return min(
            a.full_available_size() + tree.full_evictable_size(), a.swa_available_size() + tree.swa_evictable_size()
        )

    @contextlib.contextmanager
    def _settings(self) -> Iterator[None]:
        with self.s.envs.SGLANG_SWA_EVICTION_INTERVAL.override(self.page_size):
            yield

    # -- the protocol: SGLang's code under this deployment's settings ------------------------------
    def admit(self, uid: int, budget: int) -> int | None:
        with self._settings():
            return super().admit(uid, budget)

    def allocate(self, uid: int, start: int, end: int) -> bool:
        with self._settings():
            return super().allocate(uid, start, end)

    def _allocate_decode(self, uid: int, req: Any, start: int, end: int) -> bool:
        if not super()._allocate_decode(uid, req, start, end):
            return False
        req.decode_batch_idx += 1  # prepare_for_decode, after alloc_for_decode (schedule_batch.py:3783)
        return True

    def computed(self, uid: int, start: int, end: int, token: int | None) -> None:
        with self._settings():
            super().computed(uid, start, end, token)

    def finish(self, uid: int) -> None:
        with self._settings():
            super().finish(uid)

    def abort(self, uid: int) -> None:
        with self._settings():
            super().abort(uid)

    def preempt(self, uid: int) -> None:
        with self._settings():
            super().preempt(uid)

    def view(self) -> View:
        return read_swa_view(self)


# -- what the judge reads ----------------------------------------------------------------------------
def read_swa_view(subject: SglangSwaSubject) -> View:
    """The full-attention view of `read_view`, plus the SWA group: each live request's SWA row
    (through the allocator's full_to_swa_index_mapping), the SWA allocator's free pages and
    counters, and each tree node's SWA value."""
    allocator, tree = subject.allocator, subject.tree
    # the first pool is the full-attention sub-allocator: read_view reads its free pages and counts;
    # the room the PrefillAdder counts is SWAPrefillBudget's (full available + full evictable)
    full = types.SimpleNamespace(**{**vars(subject), "allocator": allocator.full_attn_allocator})
    view = read_view(cast(Any, full))
    view.counters["available_tokens"] = int(allocator.create_prefill_budget(tree)._available_and_evictable())
    ps = subject.page_size
    shift = (subject.capabilities.pages[-1] + 1) * ps  # SWA location 0 is past the full pool
    mapping = allocator.full_to_swa_index_mapping
    rows: Dict[int, List[int | None]] = {}
    for uid, row in view.requests.items():
        swa = mapping[subject.s.torch.tensor(row, dtype=subject.s.torch.int64)].tolist() if row else []
        rows[uid] = [None if loc <= 0 else int(loc) + shift for loc in swa]
    swa_alloc = allocator.swa_attn_allocator
    if isinstance(swa_alloc, subject.s.PagedTokenToKVPoolAllocator):
        pages = swa_alloc.free_pages.tolist() + [p for part in swa_alloc.staged_pages for p in part.tolist()]
    else:  # page size 1: TokenToKVPoolAllocator
        pages = swa_alloc.free_pages.tolist() + swa_alloc.release_pages.tolist()
    free = [p + shift // ps for p in pages]
    view.groups = [
        GroupView(
            name="swa",
            window=subject.window,
            requests=rows,
            free=free,
            counters={
                "free_pages": allocator.swa_available_size() // ps,
                "cached_tokens": int(tree.total_size()[1]),
            },
        )
    ]
    view.cached += swa_entries(tree, shift)
    return view


def swa_entries(tree: Any, shift: int) -> List[CachedEntry]:
    """An entry of group 1 per tree node whose SWA value lives (a tombstone holds no SWA slot)."""
    root = tree.root_node
    entries: List[CachedEntry] = []
    for node in tree.tree_core._collect_all_nodes():
        if node is root:
            continue
        value = node.component_data[SWA].value
        if value is None:
            continue
        path = []
        up = node
        while up is not None and up is not root:
            path.append(up.key.token_ids)
            up = up.parent
        tokens = tuple(int(t) for part in reversed(path) for t in part)
        entries.append(
            CachedEntry(
                locations=tuple(int(loc) + shift for loc in value.tolist()),
                start=len(tokens) - len(node.key),
                tokens=tokens,
                lock=None,
                name=f"node {node.id} (swa)",
                group=SWA,
            )
        )
    return entries
