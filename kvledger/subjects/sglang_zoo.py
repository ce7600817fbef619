"""The sglang subjects' zoos: single planted bugs in SGLang 0.5.23's cache, each an edit of its
installed source (texts as in the dedented source). `kvledger zoo --subject sglang` (the default
UnifiedRadixCache: UNIFIED_ZOO) and `--subject sglang:radix` (the classic RadixCache: RADIX_ZOO)
run each and expect the judge to name it."""

from __future__ import annotations

from typing import Tuple

from kvledger.subjects.edits import SourceEdit
from kvledger.subjects.sglang_import import COMMON, FULL_COMPONENT, PAGED, RADIX_CACHE, SCHEDULE_BATCH, UNIFIED

# Each edit is bound on the one object of a subject that runs it (the tree, its tree core or
# components, the allocator, every Req or ScheduleBatch), or, for a module function, replaces
# the function the adapter calls.
RADIX_ZOO: Tuple[SourceEdit, ...] = (
    SourceEdit(
        "sglang-split-node-drops-lock",
        f"{RADIX_CACHE}:RadixCache._split_node",
        "new_node.lock_ref = child.lock_ref",
        "new_node.lock_ref = 0",
        "splitting a locked node without copying its lock to the new parent: the shared head of a "
        "path in use counts as evictable, and an allocation can evict it under its holder",
    ),
    SourceEdit(
        "sglang-inc-lock-ref-leaf-only",
        f"{RADIX_CACHE}:RadixCache.inc_lock_ref",
        "while node != self.root_node:",
        "if node != self.root_node:",
        "locking only the matched node, not its ancestors: a match that ends below the first node "
        "leaves the path above it evictable, and the unlock walks the whole path down past zero",
    ),
    SourceEdit(
        "sglang-dec-lock-ref-keeps-protected",
        f"{RADIX_CACHE}:RadixCache.dec_lock_ref",
        "if node.lock_ref == 1:",
        "if node.lock_ref == 0:",
        "testing the count after the decrement as if before: a node its last holder unlocks is never "
        "counted evictable again, so the cache's sizes drift from its nodes",
    ),
    SourceEdit(
        "sglang-evict-forgets-free",
        f"{RADIX_CACHE}:RadixCache.evict",
        "self.token_to_kv_pool_allocator.free_segment(x.value, start_pos=0)",
        "pass",
        "deleting an evicted leaf without giving its pages back: every eviction leaks its pages",
    ),
    SourceEdit(
        "sglang-insert-frees-from-zero",
        f"{RADIX_CACHE}:RadixCache._insert_cache",
        "kv_indices[req.kv.cache_protected_len : result.prefix_len]",
        "kv_indices[: result.prefix_len]",
        "freeing the duplicates a checkpoint found from the row's start instead of past the prefix the "
        "tree already owns: the request's own matched pages, still cached and locked, go back to the "
        "free list",
    ),
    SourceEdit(
        "sglang-checkpoint-keeps-duplicate-row",
        f"{RADIX_CACHE}:RadixCache.checkpoint",
        "self.req_to_token_pool.write(\n"
        "        (req.kv.req_pool_idx, slice(req.kv.cache_protected_len, len(new_indices))),\n"
        "        new_indices[req.kv.cache_protected_len :],\n"
        "    )",
        "pass",
        "freeing the request's duplicate pages without pointing its row at the tree's copies (the "
        "mini-sglang bug of PR #142): a running request keeps reading pages that were freed",
    ),
    SourceEdit(
        "sglang-free-segment-every-token",
        f"{PAGED}:PagedTokenToKVPoolAllocator.free_segment",
        "reps = free_index[::ps]",
        "reps = free_index",
        "dropping the page stride when turning a segment into pages: each freed page is put back once "
        "per token it held",
    ),
    SourceEdit(
        "sglang-release-frees-protected",
        f"{COMMON}:release_kv_cache",
        "tree_cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, owned_kv_len)])",
        "tree_cache.free_kv_row(req.kv, [(0, owned_kv_len)])",
        "freeing the whole row at release, the prefix the tree owns included: cached pages go back to "
        "the free list while the tree (and any request that hits them) still uses them",
    ),
    SourceEdit(
        "sglang-release-keeps-lock",
        f"{COMMON}:release_kv_cache",
        "tree_cache.unlock(req.lock)\n",
        "\n",
        "releasing a request without dropping its tree lock: its path stays locked after it ends, never evictable",
    ),
    SourceEdit(
        "sglang-hit-covers-last-token",
        f"{SCHEDULE_BATCH}:Req._compute_max_prefix_len",
        "max_prefix_len = input_len - 1",
        "max_prefix_len = input_len",
        "letting the match run to the end of the prompt: a fully cached prompt of whole pages is "
        "admitted with nothing to compute, so no forward pass yields its next token",
    ),
)

# The default tree: UnifiedRadixCache over the Python tree core, with its FULL component
# (`unified_cache/components/full.py:FullComponent`), where the locks, splits and evictions of the
# full-attention KV live.
FULL = f"{FULL_COMPONENT}:FullComponent"
UNIFIED_ZOO: Tuple[SourceEdit, ...] = (
    SourceEdit(
        "sglang-unified-split-drops-lock",
        f"{FULL}.redistribute_on_node_split",
        "new_parent.component_data[ct].lock_ref = child.component_data[ct].lock_ref",
        "new_parent.component_data[ct].lock_ref = 0",
        "a node split hands the new parent no lock count: the shared head of a path a request holds "
        "counts as unlocked, and eviction can take it from under its holder",
    ),
    SourceEdit(
        "sglang-unified-lock-anchor-only",
        f"{FULL}.acquire_component_lock",
        "        cur = cur.parent\n    result.delta = delta",
        "        break\n    result.delta = delta",
        "locking only the anchor node of a match, not the path above it: the ancestors stay evictable "
        "while a request reads them",
    ),
    SourceEdit(
        "sglang-unified-unlock-counts-after-decrement",
        f"{FULL}.release_component_lock",
        "if cd.lock_ref == 1 and cd.value is not None:",
        "if cd.lock_ref == 0 and cd.value is not None:",
        "testing the lock count after the decrement as if before: a node its last holder unlocks is "
        "never moved back to evictable, so the tree's evictable and protected sizes drift from its nodes",
    ),
    SourceEdit(
        "sglang-unified-evict-forgets-free",
        f"{FULL}.evict_component",
        "device_frees[self.component_type].append(cd.value)",
        "pass",
        "evicting a node's full KV without queueing its pages to be freed: every eviction leaks its pages",
    ),
    SourceEdit(
        "sglang-unified-checkpoint-keeps-duplicate-row",
        f"{UNIFIED}:UnifiedRadixCache.checkpoint_into_tree",
        "self.req_to_token_pool.write(\n"
        "        (req.kv.req_pool_idx, slice(req.kv.cache_protected_len, len(new_indices))),\n"
        "        new_indices[req.kv.cache_protected_len :],\n"
        "    )",
        "pass",
        "the insert frees the request's duplicate pages but its row is not pointed at the tree's copies "
        "(mini-sglang PR #142's bug, in the unified tree): a running request keeps reading freed pages",
    ),
)

# Chunked prefill's checkpoint at the next step and the abort that releases the request without one
# (Scheduler.stash_chunked_request -> checkpoint_kv_cache -> UnifiedRadixCache.checkpoint_into_tree;
# process_pending_chunked_abort -> release_kv_cache(checkpoint=False)), on the default tree
CHECKPOINT = f"{UNIFIED}:UnifiedRadixCache.checkpoint_into_tree"
CHUNK_ZOO: Tuple[SourceEdit, ...] = (
    SourceEdit(
        "sglang-chunk-stash-keeps-protected-len",
        CHECKPOINT,
        "req.kv.cache_protected_len = len(new_indices)",
        "pass",
        "the checkpoint of a chunk does not advance the request's protected length past what it "
        "filed: an abort (or the next checkpoint) frees pages the tree now owns",
    ),
    SourceEdit(
        "sglang-chunk-stash-keeps-old-lock",
        CHECKPOINT,
        "self.unlock(req.lock)\n",
        "\n",
        "the checkpoint locks the chunk's new last node without unlocking the node the request held: "
        "the old path stays locked after the request is aborted or finished",
    ),
    SourceEdit(
        "sglang-chunk-stash-frees-matched-prefix",
        CHECKPOINT,
        "prev_prefix_len=req.kv.cache_protected_len,",
        "prev_prefix_len=0,",
        "the checkpoint's insert is told the request protects nothing: the pages of its own matched "
        "and earlier-filed prefix count as duplicates and are freed under it",
    ),
    SourceEdit(
        "sglang-chunk-stash-past-the-chunk",
        f"{COMMON}:checkpoint_kv_cache",
        "tree_cache.checkpoint(req, up_to=req.extend_end)",
        "tree_cache.checkpoint(req, up_to=len(req.full_untruncated_fill_ids))",
        "stashing a chunked request files its whole prompt, not the chunk computed so far: pages "
        "with no KV yet are cached and can be hit",
    ),
    SourceEdit(
        "sglang-chunk-abort-frees-from-zero",
        f"{COMMON}:release_kv_cache",
        "tree_cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, owned_kv_len)])",
        "tree_cache.free_kv_row(req.kv, [(0, owned_kv_len)])",
        "releasing a request (an aborted chunked prefill, a retraction, a finish) frees its whole row, "
        "the prefix its checkpoints filed included: the tree keeps pages that are free",
    ),
)
