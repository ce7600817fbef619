"""Planted bugs for vllm:spec and vllm:async: single edits of vllm 0.33.0's real scheduler paths.

Each edit is a mistake a maintainer could make on the code that speculative decoding or async
scheduling adds to the plain path (texts as in the method's dedented source; bound on the one
object of a subject's Scheduler or KVCacheManager that runs the method, `edits.bind`). Where a
historical vLLM bug made the same mistake, its description says which.
"""

from __future__ import annotations

from typing import Dict, Tuple

from kvledger.subjects.edits import SourceEdit
from kvledger.subjects.vllm import ZOO as MANAGER_ZOO

SCHEDULER = "vllm.v1.core.sched.scheduler"
ASYNC_SCHEDULER = "vllm.v1.core.sched.async_scheduler"

# the edits of AsyncScheduler._update_after_schedule span from its super() call (kept: an edited
# copy closes over `__class__` as the original does) to the text they change, so that it is unique
_SUPER = "super()._update_after_schedule(scheduler_output)"
_TO_CHUNK_CHECK = (
    "\n    spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens"
    "\n    # Use the latest num of scheduled draft tokens in next step as placeholder."
    "\n    self._spec_token_placeholders = [\n        -1\n    ] * scheduler_output.num_spec_tokens_to_schedule"
    "\n    for req_id in scheduler_output.num_scheduled_tokens:"
    "\n        request = self.requests[req_id]\n        "
)
_TO_PLACEHOLDERS = (
    _TO_CHUNK_CHECK + "if request.is_prefill_chunk:\n            continue\n"
    "\n        scheduler_output.pending_structured_output_tokens |= ("
    "\n            request.use_structured_output and request.num_output_placeholders > 0\n        )"
    "\n        # The request will generate num_sampled_tokens_per_step new tokens"
    "\n        # plus num_spec_tokens in this scheduling step. Diffusion has no AR"
    "\n        # bonus token (num_sampled_tokens_per_step == 0) \u2014 only the canvas"
    "\n        # (spec) tokens."
    "\n        cur_num_spec_tokens = len(spec_decode_tokens.get(req_id, ()))"
    "\n        request.num_output_placeholders += (\n            "
)

SPEC_ZOO: Tuple[SourceEdit, ...] = (
    SourceEdit(
        "vllm-spec-no-rollback",
        f"{SCHEDULER}:Scheduler.update_from_output",
        "request.num_computed_tokens -= num_rejected",
        "pass",
        "not rolling num_computed_tokens back by the rejected drafts, so KV written for rejected "
        "tokens counts as computed (modelled on vllm-project/vllm#42722: the rollback was skipped "
        "for a verification step whose output was empty, leaving num_computed_tokens too high)",
    ),
    SourceEdit(
        "vllm-spec-accepted-counts-bonus",
        f"{SCHEDULER}:Scheduler.update_from_output",
        "num_accepted = max(len(generated_token_ids) - num_sampled, 0)",
        "num_accepted = len(generated_token_ids)",
        "counting the bonus token among the accepted drafts (an off-by-one in the rejection "
        "count): one rejected position too few is rolled back, so the position of the sampled "
        "token counts as computed before its KV is written",
    ),
    SourceEdit(
        "vllm-spec-caches-unverified",
        f"{SCHEDULER}:Scheduler.update_from_output",
        "request.num_computed_tokens - request.num_in_flight_tokens,",
        "request.num_tokens,",
        "filing blocks up to the request's tokens after a verification step instead of up to its "
        "computed KV: the block holding the bonus token is filed while that position still holds "
        "a rejected draft's KV (the mistake allocate_slots' own note on 'non-committable' draft "
        "tokens guards against, in the cache_blocks update_from_output runs after verification)",
    ),
    SourceEdit(
        "vllm-spec-drafts-past-budget",
        f"{SCHEDULER}:Scheduler.schedule",
        "if len(spec_token_ids) > num_scheduled_spec_tokens:",
        "if len(spec_token_ids) > self.num_spec_tokens:",
        "not trimming the drafts to the tokens the budget left when a step's budget is smaller "
        "than 1 + K: the step claims drafts at positions it gave no token to, and the rejection "
        "count of its output no longer matches what was scheduled",
    ),
    SourceEdit(
        "vllm-spec-lookahead-counts-drafts",
        f"{SCHEDULER}:Scheduler.schedule",
        "num_lookahead_tokens=self.num_lookahead_tokens,",
        "num_lookahead_tokens=self.num_lookahead_tokens + self.num_spec_tokens,",
        "reserving the drafts again as lookahead slots though num_new_tokens already counts them "
        "(the drift VllmConfig.num_lookahead_tokens' docstring warns of: consumers re-deriving "
        "their own lookahead): each decode step holds K slots more than speculation needs, past "
        "what the subject declares (max_ahead), and a full pool preempts requests for nothing",
    ),
)

ASYNC_ZOO: Tuple[SourceEdit, ...] = (
    SourceEdit(
        "vllm-async-placeholders-not-resolved",
        f"{SCHEDULER}:Scheduler._update_request_with_output",
        "request.num_output_placeholders -= num_new_tokens",
        "pass",
        "not resolving a step's output placeholders when its tokens arrive: the running loop "
        "(num_tokens_with_spec + num_output_placeholders - num_computed_tokens) schedules "
        "positions for tokens that do not exist",
    ),
    SourceEdit(
        "vllm-async-placeholder-for-prefill-chunk",
        f"{ASYNC_SCHEDULER}:AsyncScheduler._update_after_schedule",
        _SUPER + _TO_CHUNK_CHECK + "if request.is_prefill_chunk:\n            continue",
        _SUPER + _TO_CHUNK_CHECK + "pass",
        "adding an output placeholder for a prefill chunk, which samples nothing: AsyncScheduler "
        "before its is_prefill_chunk guard (vllm-project/vllm#33652; placeholder accounting around "
        "chunked prefill is the subject of #30142, #35759 and #50692): the next chunk is scheduled "
        "one position past the prompt's known tokens",
    ),
    SourceEdit(
        "vllm-async-placeholders-count-scheduled-tokens",
        f"{ASYNC_SCHEDULER}:AsyncScheduler._update_after_schedule",
        _SUPER + _TO_PLACEHOLDERS + "self.num_sampled_tokens_per_step + cur_num_spec_tokens",
        _SUPER + _TO_PLACEHOLDERS + "scheduler_output.num_scheduled_tokens[req_id]",
        "counting a step's scheduled tokens as its outputs in flight instead of the tokens it "
        "samples (one, plus its drafts): a prompt's last chunk leaves as many placeholders as it "
        "had tokens, and the next step is scheduled far past the request's tokens",
    ),
    SourceEdit(
        "vllm-async-stale-share-in-outputs",
        f"{SCHEDULER}:Scheduler._preempt_request",
        "request.num_stale_output_tokens = request.num_in_flight_tokens",
        "request.num_stale_output_tokens = request.num_output_placeholders",
        "measuring a preempted request's stale share in outputs in flight (placeholders) instead "
        "of tokens in flight: a victim whose prompt was in flight has one placeholder but a "
        "chunk's worth of tokens, so update_from_output drains more stale tokens than were marked "
        "(the in-flight output of a preempted request is what vllm-project/vllm#46066 and #47900 "
        "fixed: num_output_placeholders underflowed when that output came back)",
    ),
    SourceEdit(
        "vllm-async-last-placeholder-kept",
        f"{SCHEDULER}:Scheduler._update_request_with_output",
        "if not is_stale and request.num_output_placeholders > 0:",
        "if not is_stale and request.num_output_placeholders > 1:",
        "an off-by-one in the guard of the placeholder resolution: a request's last placeholder "
        "is never resolved once it is the only one, so when the scheduler next catches up it "
        "schedules a position for a token that is not in flight",
    ),
)

# vllm:sched runs the manager-level zoo (kvledger/subjects/vllm.py) under the real scheduler
ZOOS: Dict[str, Tuple[SourceEdit, ...]] = {"vllm:sched": MANAGER_ZOO, "vllm:spec": SPEC_ZOO, "vllm:async": ASYNC_ZOO}
