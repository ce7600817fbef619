"""`sglang:paged`'s zoo: single planted bugs on SGLang 0.5.23's decode path at page size > 1 (the
decode memory check, retract_decode, the paged decode allocation),
each an edit of its installed source (texts as in the dedented source). `kvledger zoo --subject
sglang:paged` runs each and expects the judge (or SGLang's own out-of-memory error) to name it."""

from __future__ import annotations

from typing import Tuple

from kvledger.subjects.edits import SourceEdit
from kvledger.subjects.sglang_import import PAGED, SCHEDULE_BATCH

BATCH = f"{SCHEDULE_BATCH}:ScheduleBatch"
ZOO: Tuple[SourceEdit, ...] = (
    SourceEdit(
        "sglang-paged-decode-need-off-by-one",
        f"{BATCH}.new_tokens_required_next_decode",
        "1 for r in requests if r.kv.kv_committed_len % page_size == 0",
        "1 for r in requests if (r.kv.kv_committed_len + 1) % page_size == 0",
        "the decode memory check counts a new page for a request one token before its page boundary "
        "instead of at it: a step whose requests start new pages passes the check on a full pool, and "
        "the decode allocation runs out of memory (SGLang's 'Decode out of memory' error)",
    ),
    SourceEdit(
        "sglang-paged-retract-one-only",
        f"{BATCH}.retract_decode",
        "while first_iter or (\n        not self.check_decode_mem(selected_indices=sorted_indices)\n    ):",
        "while first_iter:",
        "retract_decode releases one request and stops, without checking that the rest now fits: a "
        "step that needs two victims' pages runs out of memory in the decode allocation",
    ),
    SourceEdit(
        "sglang-paged-alloc-decode-keeps-pages-free",
        f"{PAGED}:PagedTokenToKVPoolAllocator.alloc_decode",
        "self.free_pages = self.free_pages[num_new_pages:]\n    return out_indices",
        "return out_indices",
        "the paged decode allocation hands out new pages without taking them off the free list: the "
        "next allocation gives the same page to another request",
    ),
    SourceEdit(
        "sglang-paged-alloc-decode-strict-fit",
        f"{PAGED}:PagedTokenToKVPoolAllocator.alloc_decode",
        "if num_new_pages > len(self.free_pages):",
        "if num_new_pages >= len(self.free_pages):",
        "the paged decode allocation refuses a step that needs exactly the free pages left, which the "
        "memory check (and retract_decode) promised: the step fails out of memory",
    ),
    SourceEdit(
        "sglang-paged-decode-need-in-pages",
        f"{BATCH}.new_tokens_required_next_decode",
        "return new_pages * page_size + num_beam_member_rows(requests)",
        "return new_pages + num_beam_member_rows(requests)",
        "the decode memory check reports the pages the step needs where the allocator expects tokens: a "
        "step that needs more pages than are free or evictable passes the check, and the decode "
        "allocation runs out of memory",
    ),
)
