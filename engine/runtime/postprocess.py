"""After a batch's forward pass: its tokens, and its operation on the cache scheduler.

`sample` takes the step's tokens once they are on the host, sampling the non-greedy rows on the
CPU; `complete` runs the step's bookkeeping on the cache scheduler (with placeholder tokens under
overlap) and queues its operation for the observers; `release` gives that operation its tokens
once they are known (overlap), so the observers hear of it. Which requests stop, and what is
delivered, the engine asks its request records (`requests.py`).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from kvledger import fast
from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.engine.ledger.ops import Decode, Prefill
from kvledger.engine.runtime.model_runner import ModelRunner
from kvledger.engine.runtime.op_stream import OpStream, step_record
from kvledger.engine.runtime.overlap import LaunchedStep
from kvledger.engine.runtime.sampling import Sampler


class Postprocessor:
    def __init__(
        self, cache_scheduler: CacheScheduler, ops: OpStream, sampler: Sampler, runner: ModelRunner, budget: int
    ) -> None:
        self.cache_scheduler, self.ops, self.sampler, self.runner = cache_scheduler, ops, sampler, runner
        self.budget = budget  # the prefill budget its operations record

    def sample(self, step: LaunchedStep, params: Sequence[fast.SamplingParams]) -> None:
        """The step's tokens are on the host: take the greedy ones; sample the rows whose `params`
        are not greedy on the CPU (their tokens replace the greedy ones for the next decode step)."""
        if all(p.is_greedy for p in params):
            step.values = step.host.tolist()
            return
        uids = [step.requests[i].uid for i in step.sampled]
        result = self.sampler.sample(step.logits, uids, params)  # greedy rows need no generator
        step.values, step.failed = result.tokens, result.failed
        self.runner.set_next_tokens([step.requests[i].table_idx for i in step.sampled], step.values)

    def complete(self, step: LaunchedStep, stop: List[int]) -> None:
        """The step's bookkeeping on the cache scheduler, with placeholder tokens if its own are
        not known yet; `stop`: the uids it releases (a stop token, a failed sampling, a late stop).
        Fills in each finishing request's reason, and queues the operation for the observers."""
        reqs, values = step.requests, step.values
        sample = _by_row(len(reqs), step.sampled, values)
        self.cache_scheduler.complete(reqs, sample, stop, step.batch.phase == "prefill")
        patch_at: List[int] = []  # per sampled row: where append_host put its token
        failed, stopping, finished = step.failed, set(stop), step.finished
        for i in step.sampled:
            req = reqs[i]
            patch_at.append(req.device_len - 1)
            # a request whose sampling failed finishes like a stop; its placeholder token is not output
            if req.uid in failed:
                finished[req.uid] = "error"
            elif req.uid in stopping:
                finished[req.uid] = "stop"
            elif not req.can_decode:
                finished[req.uid] = "length"
        step.patch_at = patch_at
        record = step_record(
            step.batch.phase,
            self.budget,
            sample,
            stop,
            [r.uid for r in reqs],
            step.batch.preempted,
            self.cache_scheduler.preempts,
        )
        step.entry = self.ops.record(record, ready=values is not None)

    def release(self, step: LaunchedStep) -> None:
        """The tokens of a step completed on placeholders are known: its operation gets them, and
        the observers hear of it (and of any waiting behind it)."""
        entry = step.operation()
        op = entry.record.op
        assert isinstance(op, (Prefill, Decode))  # a step's operation (step_record)
        entry.fill_sample(_by_row(len(op.sample), step.sampled, step.tokens(), op.sample))
        self.ops.flush()


def _by_row(n: int, sampled: List[int], values: Optional[Sequence[int]], fill: Sequence[int] = ()) -> List[int]:
    """Per row of a batch of `n`: the sampled rows' `values` (None: not known yet), the other rows'
    entry of `fill` (0 without one)."""
    if values is not None and len(sampled) == n == len(values):  # every row sampled: sampled is 0, 1, ..., n - 1
        return list(values)
    sample = list(fill) if fill else [0] * n
    if values is not None:
        for i, t in zip(sampled, values):
            sample[i] = t
    return sample
