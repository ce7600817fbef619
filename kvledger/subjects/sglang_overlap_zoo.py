"""`sglang:overlap`'s zoo: single planted bugs on SGLang 0.5.23's overlap path (the decode reserve
that absorbs the lag of kv_committed_len, the allocation ahead, the free groups of result
processing, the release of the tail a request holds ahead), each an edit of its installed source
(texts as in the dedented source). `kvledger zoo --subject sglang:overlap` runs each and expects
the judge (or SGLang's own assertions and out-of-memory errors) to name it.

Each is a mistake the overlap loop makes easy: a step N+1 allocated from a length that does not
yet count step N's tokens, frees held back in a group and released (or not) at its end."""

from __future__ import annotations

from typing import Tuple

from kvledger.subjects.edits import SourceEdit
from kvledger.subjects.sglang_import import COMMON, PAGED, SCHEDULE_BATCH
from kvledger.subjects.sglang_spec_zoo import ALLOCATION_SIZING

ZOO: Tuple[SourceEdit, ...] = (
    SourceEdit(
        "sglang-overlap-reserve-one-step",
        f"{ALLOCATION_SIZING}:get_alloc_reserve_per_decode",
        "return 2 * get_alloc_len_per_decode()",
        "return get_alloc_len_per_decode()",
        "dropping the 2x decode reserve (the double buffer for the lag of kv_committed_len under "
        "overlap): step N+1 is allocated before step N's accepted run is committed, so one step's "
        "length past the stale committed length does not reach the positions step N+1 writes",
    ),
    SourceEdit(
        "sglang-overlap-alloc-from-committed",
        f"{ALLOCATION_SIZING}:page_aligned_decode_alloc_lens",
        "cur = r.kv.kv_allocated_len",
        "cur = r.kv.kv_committed_len",
        "allocating step N+1 from kv_committed_len instead of kv_allocated_len: the slots already "
        "allocated ahead (for step N, still in flight) are allocated again and the row is rewritten, "
        "so the pages it held before are owned by nobody",
    ),
    SourceEdit(
        "sglang-overlap-release-tail-to-committed",
        f"{COMMON}:release_kv_cache",
        "req, owned_kv_len, req.kv.kv_allocated_len, tree_cache",
        "req, owned_kv_len, req.kv.kv_committed_len, tree_cache",
        "releasing a finished request up to kv_committed_len instead of kv_allocated_len: the slots "
        "allocated ahead for the step in flight are never freed",
    ),
    SourceEdit(
        "sglang-overlap-group-page-ids-dropped",
        f"{PAGED}:PagedTokenToKVPoolAllocator.free_group_end",
        "self._release_page_ids(torch.cat(self.free_page_ids_group))\n        self.free_page_ids_group = []",
        "self.free_page_ids_group = []",
        "ending a free group without releasing the page ids freed inside it (free_page_ids records "
        "them in free_page_ids_group while a group is open): every release made during result "
        "processing leaks its pages",
    ),
    SourceEdit(
        "sglang-overlap-group-page-ids-as-indices",
        f"{PAGED}:PagedTokenToKVPoolAllocator.free_page_ids",
        "self.free_page_ids_group.append(self._copy_for_free_group(page_ids))",
        "self.free_group.append(self._copy_for_free_group(page_ids))",
        "holding page ids freed inside a group in the group of token indices: free_group_end frees "
        "them as token indices, so the pages released are the ones holding those indices, not the "
        "pages freed",
    ),
    SourceEdit(
        "sglang-overlap-estimate-one-step",
        f"{SCHEDULE_BATCH}:ScheduleBatch._new_tokens_required_next_decode_spec_v2",
        "reserve = get_alloc_reserve_per_decode()",
        "reserve = get_alloc_reserve_per_decode() // 2",
        "the decode memory check estimating one step's length past kv_committed_len where the "
        "allocation takes the double buffer: a step the pool cannot serve passes the check, and the "
        "allocation fails instead of the scheduler retracting",
    ),
)
