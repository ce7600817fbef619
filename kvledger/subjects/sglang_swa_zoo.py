"""The sglang:swa subject's zoo: single planted bugs on SGLang 0.5.23's sliding-window path (the SWA
pool, its allocator, the frees of what left the window, the tree's SWA component), each an edit of
its installed source (texts as in the dedented source). `kvledger zoo --subject sglang:swa` runs
each and expects the judge to name it.

Each edit is bound on the one object of the subject that runs it: the SWATokenToKVPoolAllocator,
the UnifiedRadixCache (a method it inherits from BasePrefixCache), or the tree's SWAComponent."""

from __future__ import annotations

from typing import Tuple

from kvledger.subjects.edits import SourceEdit

SWA_ALLOCATOR = "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator"
BASE_PREFIX_CACHE = "sglang.srt.mem_cache.base_prefix_cache:BasePrefixCache"
SWA_COMPONENT = "sglang.srt.mem_cache.unified_cache.components.swa:SWAComponent"

SWA_ZOO: Tuple[SourceEdit, ...] = (
    SourceEdit(
        "sglang-swa-decode-window-a-page-short",
        f"{BASE_PREFIX_CACHE}.evict_sliding_windows",
        "sliding_window_size=self.swa_retain_window,",
        "sliding_window_size=self.swa_retain_window - self.page_size,",
        "the frontier of a decode's SWA frees (maybe_evict_swa -> evict_sliding_windows) keeps a page "
        "less than the window: the step frees SWA slots of positions its own attention still reads",
    ),
    SourceEdit(
        "sglang-swa-checkpoint-frees-inside-window",
        f"{SWA_COMPONENT}._free_out_of_window_slots",
        "sliding_window_size=self.sliding_window_size,",
        "sliding_window_size=self.cache.page_size,",
        "a checkpoint (a prefill chunk or a finished prefill inserted into the tree) measures what left "
        "the window by the page size instead of the window: it frees SWA slots the next chunk or "
        "decode step still reads",
    ),
    SourceEdit(
        "sglang-swa-free-keeps-mapping",
        f"{SWA_ALLOCATOR}._free_swa_pages_none_cuda",
        "    self.clear_full_to_swa_mapping(mapping_indices)\n    return swa_pages",
        "    return swa_pages",
        "freeing a segment's SWA pages without clearing full_to_swa_index_mapping: the request's row "
        "still maps those positions to SWA slots that are back in the free list, and handed out again",
    ),
    SourceEdit(
        "sglang-swa-frees-into-full-pool",
        f"{SWA_ALLOCATOR}._free_swa_pages",
        "self.swa_attn_allocator.free_page_ids(swa_pages)",
        "self.full_attn_allocator.free_page_ids(swa_pages)",
        "the pools crossed on a free: SWA page ids dropped outside the window go to the full-attention "
        "allocator's free list, which then hands out pages other requests hold, and the SWA pages leak",
    ),
    SourceEdit(
        "sglang-swa-available-reads-full",
        f"{SWA_ALLOCATOR}.swa_available_size",
        "return self.swa_attn_allocator.available_size()",
        "return self.full_attn_allocator.available_size()",
        "the SWA pool's room read from the full pool (the two accountings crossed): the prefill budget, "
        "the decode check and eviction size the SWA pool by the other one",
    ),
    SourceEdit(
        "sglang-swa-match-skips-tombstone-reset",
        f"{SWA_COMPONENT}.create_match_validator",
        'state["len"] = 0\n',
        "pass\n",
        "the prefix match keeps counting live SWA positions across a tombstone (a node whose SWA the "
        "tree evicted or never kept): a hit may end fewer than W live SWA positions past the evicted "
        "part, and the request's first step reads SWA KV that is gone",
    ),
)
