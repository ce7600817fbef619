"""Reading a vLLM 0.33.0 `BlockPool` as the judge's View needs it, shared by the adapters that
drive its `KVCacheManager` alone (`vllm.py`) and under the real `Scheduler`
(`vllm_scheduler_view.py`): the free queue in its order, every cached block with its key and KV
cache group, and the key a prefix is filed under, recomputed with vLLM's own hash functions."""

from __future__ import annotations

from typing import Any, Dict, Hashable, List, Sequence, Tuple

from kvledger.properties.subject import CachedEntry


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


def cached_blocks(pool: Any, bs: int) -> List[CachedEntry]:
    """Every block filed in `BlockPool.cached_block_hash_to_block`, with its key and group. A key
    maps to one block, or to {block_id: block} when several were filed under it (vLLM does not
    deduplicate)."""
    from vllm.v1.core.kv_cache_utils import get_group_id

    cached: List[CachedEntry] = []
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
    return cached


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
