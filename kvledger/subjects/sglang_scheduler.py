"""What SGLang's `Scheduler` keeps around the cache between the sglang subject's calls: each
request's phase, the scheduling step in progress, this prefill pass's reservations and the
new-token ratio, and the `PrefillAdder`'s memory budget computed from them as SGLang computes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Set, Tuple

from kvledger.subjects.sglang_import import SglangNames


@dataclass
class SglangRequest:
    req: Any  # its sglang Req
    phase: str = "waiting"  # waiting (new or retracted) -> admitted (prefilling) -> running (decoding)
    order: int = 0  # admission order, for the running batch


class SchedulerState:
    """The step in progress, the prefill pass's reservations and the new-token ratio."""

    def __init__(self, s: SglangNames) -> None:
        self.s = s
        # SGLang's knobs, read from the environment as its scheduler reads them at start
        # (SGLANG_INIT_NEW_TOKEN_RATIO, _MIN_NEW_TOKEN_RATIO_FACTOR, _NEW_TOKEN_RATIO_DECAY_STEPS)
        self.ratio = s.NewTokenRatioTracker.from_config()
        self.retract_decode_steps: int = s.envs.SGLANG_RETRACT_DECODE_STEPS.get()
        # the most decode tokens the PrefillAdder counts per request (schedule_policy.CLIP_MAX_NEW_TOKENS,
        # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION read when that module is imported)
        self.clip: int = s.CLIP_MAX_NEW_TOKENS
        self.step: str | None = None  # the kind of the step in progress: "prefill", "decode" or None
        self._calls: Set[Tuple[int, str]] = set()  # (uid, call) made in the step in progress
        # this prefill pass's reservations (PrefillAdder._update_prefill_budget): uid -> (chunk, decode
        # tokens reserved, tokens its allocations have taken since)
        self.reservations: Dict[int, List[int]] = {}

    def begin(self, kind: str, uid: int, call: str) -> bool:
        """Note a call of a scheduling step; the first of a new step starts it (True). A step ends
        with its results (computed); one that ran nothing has none, so a call of the other kind,
        or a second call for the same request, starts the next step too."""
        if self.step == kind and (uid, call) not in self._calls:
            self._calls.add((uid, call))
            return False
        self.step = kind
        self._calls = {(uid, call)}
        self.reservations = {}
        if kind == "decode":
            # update_running_batch: a decode step that needs no retraction decays the ratio; a
            # retraction (preempt) sets it afresh instead
            self.ratio.decay_step()
        return True

    def retry(self, uid: int, call: str) -> None:
        """A call that found no room: it is made again after a retraction, in this step."""
        self._calls.discard((uid, call))

    def reserve(self, uid: int, chunk: int, decode_tokens: int) -> None:
        self.reservations[uid] = [chunk, decode_tokens, 0]

    def took(self, uid: int, tokens: int) -> None:
        """An allocation of this pass took `tokens` of `uid`'s reservation."""
        self.reservations[uid][2] += tokens

    def forget(self, uid: int) -> None:
        self.reservations.pop(uid, None)

    def max_new(self, req: Any) -> int:
        return min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), self.clip)

    def prefill_budget(self, allocator: Any, tree: Any, running: Sequence[SglangRequest]) -> Any:
        """The PrefillAdder's memory budget as it stands now in this pass: SGLang's PrefillBudget
        (allocator.create_prefill_budget) charged the running requests' estimated decode tokens
        (PrefillAdder.__init__, _get_running_request_total_token_offset) and this pass's
        admissions (_update_prefill_budget -> PrefillBudget.reserve). SGLang allocates the whole
        batch after the adder is done; the driver allocates each request right after admitting
        it, so what an admission of this pass has allocated since is taken off its reservation."""
        budget = allocator.create_prefill_budget(tree)
        clip = self.clip
        for r in running:
            req = r.req
            ratio = 1.0 if req.sampling_params.ignore_eos else self.ratio.current
            budget.total_offset += min(req.sampling_params.max_new_tokens - len(req.output_ids), clip) * ratio
        for chunk, decode_tokens, taken in self.reservations.values():
            budget.reserve(chunk, decode_tokens)
            budget.total_offset -= taken
            budget.current_offset -= taken
        return budget

    def after_retract(self, remaining: Sequence[SglangRequest]) -> None:
        """The scheduler sets new_token_ratio from the requests still running after a retraction."""
        self.ratio.current = self.s.NewTokenRatioTracker.estimate_new_token_ratio_after_retract(
            [o.req for o in remaining]
        )

    def idle(self, live: int) -> None:
        # Scheduler.self_check_during_idle ends with new_token_ratio_tracker.reset()
        if not live:
            self.ratio.reset()
