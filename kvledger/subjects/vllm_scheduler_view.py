"""What the judge reads of a real vLLM `Scheduler`: its `KVCacheManager`'s block tables, free
queue, prefix-cache map and counts, and its waiting queue, as a kvledger `View`; and the key its
prefix cache files a prefix under, per KV cache group.

Every field reads the scheduler's own structures (never a value recomputed by the adapter):
  requests  group 0's block table of each request that holds one (`req_to_blocks`), the WHOLE
            table: positions past the tokens (lookahead slots, drafts, async placeholders) show
  groups    the tables of the groups past the first, a null block's positions as None
  cached    `BlockHashToBlockMap._cache`, each block under its key; the group comes from the key
  free      `FreeKVCacheBlockQueue` in its order
  waiting   the uids of `kv_holding_waiting` then `waiting`, in the order the scheduler pops them
"""

from __future__ import annotations

from typing import Any, Dict, Hashable, List, Sequence, Tuple

from kvledger.properties.subject import CachedEntry, GroupView, View
from kvledger.subjects.vllm_scheduler_build import Group


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


def free_queue(pool: Any) -> List[int]:
    """The block ids of FreeKVCacheBlockQueue in its order (fake head to fake tail), stopped after
    as many steps as there are blocks and one more, so a cycle shows the repeat instead of hanging."""
    queue = pool.free_block_queue
    ids: List[int] = []
    block = queue.fake_free_list_head.next_free_block
    while block is not None and block.next_free_block is not None and len(ids) <= len(pool.blocks):
        ids.append(block.block_id)
        block = block.next_free_block
    return ids


def scheduler_view(scheduler: Any, bs: int, kinds: Sequence[Group]) -> View:
    """The View of a scheduler over KV cache groups of `kinds` (full, sliding window, chunked local)."""
    from vllm.v1.core.kv_cache_utils import get_group_id

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
    cached: List[CachedEntry] = []
    # a key maps to one block, or to {block_id: block} when several were filed under it
    for key, blocks in pool.cached_block_hash_to_block._cache.items():
        for block in blocks.values() if isinstance(blocks, dict) else (blocks,):
            b = block.block_id
            cached.append(
                CachedEntry(
                    locations=tuple(range(b * bs, b * bs + bs)),
                    start=None,
                    key=key,
                    name=f"block {b}",
                    group=get_group_id(key),
                )
            )
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


class CacheKeys:
    """The key BlockPool.cache_full_blocks files a prefix's last full block under:
    hash_block_tokens(sha256) chained over its full blocks from NONE_HASH, with the extra keys
    generate_block_hash_extra_keys gives a plain text request, plus the group id. vLLM's module
    functions, never a bound (possibly edited) method; memoized per (parent, block)."""

    def __init__(self, bs: int) -> None:
        self.bs = bs
        self._memo: Dict[Tuple[bytes | None, Tuple[int, ...]], bytes] = {}

    def key(self, tokens: Sequence[int], group: int = 0) -> Hashable:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_utils as utils
        from vllm.v1.request import Request

        bs = self.bs
        full = len(tokens) // bs
        if full == 0:
            return None
        prefix = [int(t) for t in tokens[: full * bs]]
        probe = None  # a plain text request of these tokens, for the extra keys
        parent: bytes | None = None
        for i in range(full):
            block = tuple(prefix[i * bs : (i + 1) * bs])
            known = self._memo.get((parent, block))
            if known is None:
                if probe is None:
                    probe = Request("cache-key", prefix, SamplingParams(max_tokens=1), None)
                extra, _ = utils.generate_block_hash_extra_keys(probe, i * bs, (i + 1) * bs, 0)
                known = self._memo[(parent, block)] = utils.hash_block_tokens(sha256, parent, block, extra)
            parent = known
        return utils.make_block_hash_with_group_id(parent, group)
