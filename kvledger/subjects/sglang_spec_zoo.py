"""The sglang:spec subject's zoo: single planted bugs on SGLang 0.5.23's speculative decoding
allocation path, each an edit of its installed source (texts as in the dedented source).
`kvledger zoo --subject sglang:spec` runs each and expects the judge to name it.

Each models a mistake of the kind this path's history shows: the over-allocated tail is the
part a release most easily forgets (SGLang frees it in a function of its own,
`_release_overallocated_kv_indices`), and the accepted length has three near names
(`accept_lens` with the bonus, `num_correct_drafts` without it, the padded stride)."""

from __future__ import annotations

from typing import Tuple

from kvledger.subjects.edits import SourceEdit
from kvledger.subjects.sglang_import import ALLOCATION, COMMON, SCHEDULE_BATCH

EAGLE_UTILS = "sglang.srt.speculative.eagle_utils"
ALLOCATION_SIZING = "sglang.srt.mem_cache.allocation_sizing"
BATCH_RESULT = "sglang.srt.managers.scheduler_components.batch_result_processor"
SCHEDULE_BATCH_MODULE = SCHEDULE_BATCH
RESOLVE = "SchedulerBatchResultProcessor._resolve_spec_v2_tokens"

ZOO: Tuple[SourceEdit, ...] = (
    SourceEdit(
        "sglang-spec-tail-not-freed",
        f"{COMMON}:_release_overallocated_kv_indices",
        "tree_cache.free_kv_row(req.kv, [(start_p, end_p)])",
        "pass",
        "releasing a request without freeing its over-allocated tail [ceil_page(owned), "
        "kv_allocated_len): every speculative request leaks the slots it held ahead",
    ),
    SourceEdit(
        "sglang-spec-tail-from-owned",
        f"{COMMON}:_release_overallocated_kv_indices",
        "start_p = ceil_align(start_p, page_size)",
        "start_p = start_p",
        "freeing the over-allocated tail from owned_kv_len instead of its page boundary: the page "
        "holding the last committed token is freed twice (once by free_kv_row, once here)",
    ),
    SourceEdit(
        "sglang-spec-commit-without-bonus",
        f"{BATCH_RESULT}:{RESOLVE}",
        "req.kv.kv_committed_len += num_accept_tokens",
        "req.kv.kv_committed_len += result.num_correct_drafts_per_req_cpu[i]",
        "advancing kv_committed_len by the drafts accepted (num_correct_drafts) instead of the "
        "accepted run with its bonus token: the committed length falls one behind per step, so the "
        "reserve is computed from a stale length and the step's slots run short",
    ),
    SourceEdit(
        "sglang-spec-commit-rejected",
        f"{BATCH_RESULT}:{RESOLVE}",
        "num_accept_tokens = len(accept_tokens)",
        "num_accept_tokens = stride",
        "advancing kv_committed_len by the padded verify width instead of the accepted run: "
        "rejected drafts count as committed KV, and the allocation runs ahead of the request",
    ),
    SourceEdit(
        "sglang-spec-allocated-not-recorded",
        f"{ALLOCATION}:alloc_for_spec_decode",
        "req.kv.kv_allocated_len = max(req.kv.kv_allocated_len, nxt_kv_len)",
        "pass",
        "allocating the step's slots and writing them into the row without recording kv_allocated_len: "
        "the row the scheduler reads ends where it did, and the next step allocates the same range again",
    ),
    SourceEdit(
        "sglang-spec-reserve-from-allocated",
        f"{ALLOCATION_SIZING}:page_aligned_decode_alloc_lens",
        "(r.kv.kv_committed_len + reserve + page_size - 1)",
        "(r.kv.kv_allocated_len + reserve + page_size - 1)",
        "computing the decode reserve past kv_allocated_len instead of kv_committed_len: each step "
        "allocates a whole reserve more, and a request's row grows without bound",
    ),
    SourceEdit(
        "sglang-spec-insert-up-to-allocated",
        f"{COMMON}:release_kv_cache",
        "tree_cache.checkpoint(req, up_to=owned_kv_len)",
        "tree_cache.checkpoint(req, up_to=req.kv.kv_allocated_len)",
        "inserting the row into the tree up to kv_allocated_len instead of the committed length: "
        "slots of rejected drafts and never-written reserve become cached prefix",
    ),
    SourceEdit(
        "sglang-spec-row-freed-to-allocated",
        f"{COMMON}:release_kv_cache",
        "tree_cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, owned_kv_len)])",
        "tree_cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, req.kv.kv_allocated_len)])",
        "freeing the row up to kv_allocated_len at release, then the over-allocated tail again: the "
        "tail's pages go back to the free list twice",
    ),
    SourceEdit(
        "sglang-spec-estimate-without-reserve",
        f"{SCHEDULE_BATCH}:ScheduleBatch._new_tokens_required_next_decode_spec_v2",
        "x = max(0, r.kv.kv_committed_len + reserve - r.kv.kv_allocated_len)",
        "x = max(0, r.kv.kv_committed_len + 1 - r.kv.kv_allocated_len)",
        "check_decode_mem estimating one token per request where the allocation takes the reserve: "
        "the memory check passes a step the pool cannot serve, and the allocation fails instead of "
        "the scheduler retracting",
    ),
)
