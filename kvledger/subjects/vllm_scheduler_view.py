"""What the judge reads of a real vLLM `Scheduler`: its `KVCacheManager`'s block tables, free
queue, prefix-cache map and counts, and its waiting queue, as a kvledger `View`; and the key its
prefix cache files a prefix under, per KV cache group (`vllm_pool.py`, shared with `vllm.py`).

Every field reads the scheduler's own structures (never a value recomputed by the adapter):
  requests  group 0's block table of each request that holds one (`req_to_blocks`), the WHOLE
            table: positions past the tokens (lookahead slots, drafts, async placeholders) show
  groups    the tables of the groups past the first, a null block's positions as None
  cached    `BlockHashToBlockMap._cache`, each block under its key; the group comes from the key
  free      `FreeKVCacheBlockQueue` in its order
  waiting   the uids of `kv_holding_waiting` then `waiting`, in the order the scheduler pops them
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from kvledger.properties.subject import GroupView, View
from kvledger.subjects.vllm_pool import CacheKeys, cached_blocks, free_queue
from kvledger.subjects.vllm_scheduler_build import Group

__all__ = ["CacheKeys", "scheduler_view"]


def _uid(request_id: str) -> int:
    return int(request_id)


def _rows(manager: Any, bs: int, null_block: Any) -> Dict[int, List[int | None]]:
    """request uid -> the location of each position its table covers in this group (None: the
    null block, which a sliding window puts where it dropped blocks)."""
    rows: Dict[int, List[int | None]] = {}
    for req_id, blocks in manager.req_to_blocks.items():
        if not blocks:
            continue
        rows[_uid(req_id)] = [
            None if block is null_block else block.block_id * bs + offset for block in blocks for offset in range(bs)
        ]
    return rows


def scheduler_view(scheduler: Any, bs: int, kinds: Sequence[Group]) -> View:
    """The View of a scheduler over KV cache groups of `kinds` (full, sliding window, chunked local)."""
    mgr = scheduler.kv_cache_manager
    pool = mgr.block_pool
    managers = mgr.coordinator.single_type_managers
    null = pool.null_block
    first = _rows(managers[0], bs, null)
    requests: Dict[int, List[int]] = {}
    for uid, row in first.items():
        # group 0 is full attention (the builder puts it first): no null block in its table; one
        # there would be a bug, shown as location -1 (not in the pool) rather than hidden
        requests[uid] = [-1 if loc is None else loc for loc in row]
    groups = [
        GroupView(
            name=f"group {g}", window=kinds[g].window, requests=_rows(managers[g], bs, null), chunk=kinds[g].chunk
        )
        for g in range(1, len(managers))
    ]
    cached = cached_blocks(pool, bs)
    waiting = [_uid(r.request_id) for r in scheduler.kv_holding_waiting] + [
        _uid(r.request_id) for r in scheduler.waiting
    ]
    return View(
        free=free_queue(pool),
        requests=requests,
        cached=cached,
        # the null block's ref_cnt is not maintained (BlockPool.__init__)
        page_refs={blk.block_id: blk.ref_cnt for blk in pool.blocks if blk is not null},
        counters={"free_pages": pool.get_num_free_blocks()},
        waiting=waiting,
        groups=groups,
    )
