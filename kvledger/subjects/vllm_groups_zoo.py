"""Planted bugs for `vllm:hybrid` (a full-attention group plus a sliding window under vLLM's
hybrid coordinator) and `vllm:external` (a KV connector's scheduler side): single edits to vllm
0.33.0, each the kind of mistake vLLM's tracker shows on these paths, bound on one subject's
objects only (`kvledger/subjects/edits.py`).

A `SlidingWindowManager` classmethod (the prefix-hit finder) is called on the class the
coordinator keeps in `attention_groups`, not on the manager object, so its edits are bound by
swapping in a subclass for that one coordinator (`vllm_hybrid.bind_finder_edits`).
"""

from __future__ import annotations

from typing import Tuple

from kvledger.subjects.edits import SourceEdit

SINGLE_TYPE = "vllm.v1.core.single_type_kv_cache_manager"
COORDINATOR = "vllm.v1.core.kv_cache_coordinator"
KV_CACHE_MANAGER = "vllm.v1.core.kv_cache_manager"
SCHEDULER = "vllm.v1.core.sched.scheduler"

HYBRID_ZOO: Tuple[SourceEdit, ...] = (
    SourceEdit(
        "vllm-swa-hit-skip-round-up",
        f"{SINGLE_TYPE}:SingleTypeKVCacheManager.add_local_computed_blocks",
        "num_skipped_blocks = num_skipped_tokens // self.block_size",
        "num_skipped_blocks = cdiv(num_skipped_tokens, self.block_size)",
        "rounding the hit's skipped tokens up to whole blocks when a sliding-window group adopts a "
        "prefix hit: the hit block that straddles the window's edge is replaced by the null block, "
        "and the first tokens computed after the hit read it",
    ),
    SourceEdit(
        "vllm-swa-room-skips-round-up",
        f"{SINGLE_TYPE}:SingleTypeKVCacheManager.get_num_blocks_to_allocate",
        "num_skipped_blocks = num_skipped_tokens // self.block_size",
        "num_skipped_blocks = cdiv(num_skipped_tokens, self.block_size)",
        "rounding the skipped tokens up in the room check: a sliding-window group claims one block "
        "fewer than it allocates, so an admission passes the check and the allocation finds no block",
    ),
    SourceEdit(
        "vllm-swa-skipped-blocks-round-up",
        f"{SINGLE_TYPE}:SingleTypeKVCacheManager.remove_skipped_blocks",
        "num_skipped_blocks = num_skipped_tokens // self.block_size",
        "num_skipped_blocks = cdiv(num_skipped_tokens, self.block_size)",
        "rounding the skipped tokens up to whole blocks: the block that straddles the window's edge "
        "is freed although its last positions are still inside the window",
    ),
    SourceEdit(
        "vllm-swa-remove-keeps-freed-block",
        f"{SINGLE_TYPE}:SingleTypeKVCacheManager._remove_blocks_in_range",
        "blocks[i] = self._null_block",
        "pass",
        "freeing the blocks that left the window without replacing them by the null block: the "
        "block table still names blocks the pool has handed back (and the next call frees them again)",
    ),
    SourceEdit(
        "vllm-swa-hit-window-round-down",
        f"{SINGLE_TYPE}:SlidingWindowManager._contiguous_blocks_for_hit",
        "blocks = cdiv(window_size - 1, block_size)",
        "blocks = (window_size - 1) // block_size",
        "rounding the contiguous blocks a sliding-window hit needs down: a hit whose window reaches "
        "into a block the cache no longer holds is accepted, and the window reads the null block",
    ),
    SourceEdit(
        "vllm-swa-hit-not-contiguous",
        f"{SINGLE_TYPE}:SlidingWindowManager.find_longest_cache_hit",
        "        else:\n            num_contiguous_blocks = 0\n",
        "",
        "not resetting the run of cached blocks at a miss: cached blocks with a hole between them "
        "count as the window's contiguous blocks, and the hole is read as the null block",
    ),
    SourceEdit(
        "vllm-hybrid-hit-not-reduced",
        f"{COORDINATOR}:HybridKVCacheCoordinator.find_longest_cache_hit",
        "            curr_hit_length = _new_hit_length\n",
        "",
        "not shortening the candidate hit to what each group's finder found: the hit stays at its upper "
        "bound (the prompt but its last token) while the groups hold blocks for what they found, so "
        "positions nobody computed count as computed",
    ),
    SourceEdit(
        "vllm-swa-window-one-short",
        f"{SINGLE_TYPE}:SlidingWindowManager.get_num_skipped_tokens",
        "num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens",
        "num_computed_tokens - self.sliding_window + 2 - self.extra_retained_tokens",
        "counting the window one token short: remove_skipped_blocks frees (and nulls) the block of "
        "the oldest position the next token still attends to, so the step reads KV that was freed "
        "and may already hold another request's",
    ),
)

EXTERNAL_ZOO: Tuple[SourceEdit, ...] = (
    SourceEdit(
        "vllm-ext-caches-before-load",
        f"{KV_CACHE_MANAGER}:KVCacheManager.allocate_slots",
        "if delay_cache_blocks:",
        "if delay_cache_blocks and False:",
        "filing the blocks of an asynchronous load in the prefix cache when they are allocated, "
        "before the KV arrives: another request hits them and reads KV nobody has written",
    ),
    SourceEdit(
        "vllm-ext-computed-misses-external",
        f"{SCHEDULER}:Scheduler.schedule",
        "num_new_local_computed_tokens + num_external_computed_tokens\n                )",
        "num_new_local_computed_tokens\n                )",
        "leaving the external tokens out of the request's computed tokens: the blocks for the "
        "loaded range are allocated, and the same range is scheduled again on top of them",
    ),
    SourceEdit(
        "vllm-ext-loaded-abort-delays-free",
        f"{SCHEDULER}:Scheduler.finish_requests",
        "is None\n                and request.request_id not in self.finished_recving_kv_req_ids\n",
        "is None\n",
        "delaying the free of an aborted request that waits for its KV without asking whether the "
        "load already reported done: one aborted after its load finished, before it was scheduled, "
        "waits for a report that never comes, and its blocks leak",
    ),
    SourceEdit(
        "vllm-ext-loaded-request-looked-up-again",
        f"{SCHEDULER}:Scheduler.schedule",
        "if request.num_computed_tokens == 0:",
        "if request.num_computed_tokens >= 0:",
        "taking a request whose KV has arrived for a fresh admission: its prefix is looked up and "
        "the connector asked again, and the hit is added on top of the blocks it already holds",
    ),
    SourceEdit(
        "vllm-ext-connector-asked-from-zero",
        f"{SCHEDULER}:Scheduler.schedule",
        "request, block_aligned_local\n",
        "request, 0\n",
        "asking the connector for the tokens it holds past position 0 instead of past the local "
        "hit: tokens found both in the local cache and outside are counted twice, and the request "
        "claims KV for positions neither holds",
    ),
)

# chunked local attention (`vllm:local`): ChunkedLocalAttentionManager, single_type_kv_cache_manager.py:1276
LOCAL_ZOO: Tuple[SourceEdit, ...] = (
    SourceEdit(
        "vllm-local-skips-the-current-chunk",
        f"{SINGLE_TYPE}:ChunkedLocalAttentionManager.get_num_skipped_tokens",
        "num_computed_tokens // self.attention_chunk_size",
        "cdiv(num_computed_tokens, self.attention_chunk_size)",
        "rounding the computed tokens up to whole chunks: once a chunk is partly computed, its "
        "blocks are freed and nulled while the next position still attends to them",
    ),
    SourceEdit(
        "vllm-local-skips-by-the-next-position",
        f"{SINGLE_TYPE}:ChunkedLocalAttentionManager.get_num_skipped_tokens",
        "num_computed_tokens // self.attention_chunk_size",
        "(num_computed_tokens + 1) // self.attention_chunk_size",
        "taking the chunk of the position after the next one (computed + 1) for the next position's: "
        "with C - 1 positions of a chunk computed, the whole chunk is dropped before its last position "
        "is computed",
    ),
    SourceEdit(
        "vllm-local-hit-nulls-a-block-too-many",
        f"{SINGLE_TYPE}:ChunkedLocalAttentionManager.find_longest_cache_hit",
        "[block_pool.null_block] * local_attention_start_block_idx",
        "[block_pool.null_block] * (local_attention_start_block_idx + 1)",
        "one null block too many in front of a chunked-local hit: the first block of the chunk the "
        "hit ends in is marked computed without its KV, and the positions after the hit read it",
    ),
    SourceEdit(
        "vllm-local-hit-start-by-block",
        f"{SINGLE_TYPE}:ChunkedLocalAttentionManager.find_longest_cache_hit",
        "// kv_cache_spec.attention_chunk_size\n            * kv_cache_spec.attention_chunk_size",
        "// kv_cache_spec.block_size\n            * kv_cache_spec.block_size",
        "the hit's local start taken at block granularity instead of the chunk's: every block of the "
        "hit but the last is replaced by the null block, though the positions after it still attend "
        "to the whole chunk",
    ),
    SourceEdit(
        "vllm-local-hit-ignores-its-chunk",
        f"{SINGLE_TYPE}:ChunkedLocalAttentionManager.find_longest_cache_hit",
        "block_hash, kv_cache_group_ids\n        ):",
        "block_hash, kv_cache_group_ids\n        ) or [block_pool.null_block] * len(kv_cache_group_ids):",
        "treating a block of the hit's chunk that is not cached as if outside the window (a null "
        "block in the hit): the hit runs past what the cache holds, and the positions after it read "
        "KV that was never computed",
    ),
)
