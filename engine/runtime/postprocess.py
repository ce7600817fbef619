"""After a batch's forward pass: its tokens, the cache scheduler's bookkeeping, the token events.

`resolve` waits for the tokens and samples the non-greedy rows on the CPU; `complete` runs the
step's bookkeeping on the cache scheduler (with placeholder tokens under overlap) and queues its
operation for the observers; `land` patches the placeholders once the tokens are known, finishes
requests that stopped, and returns the delivered tokens.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, FrozenSet, List

from torch.profiler import record_function

from kvledger import fast
from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.engine.runtime.model_runner import ModelRunner
from kvledger.engine.runtime.op_stream import OpStream, step_record
from kvledger.engine.runtime.overlap import LaunchedStep, Overlap
from kvledger.engine.runtime.requests import RequestRecord, TokenEvent
from kvledger.engine.runtime.sampling import Sampler

_GREEDY = fast.SamplingParams(temperature=0.0)


class Postprocessor:
    def __init__(
        self,
        ledger: CacheScheduler,
        ops: OpStream,
        overlap: Overlap,
        sampler: Sampler,
        runner: ModelRunner,
        requests: Dict[int, RequestRecord],
        eos_token_ids: FrozenSet[int],
        budget: int,
        forget: Callable[[int], None],
        host_seconds: Dict[str, float],
    ) -> None:
        self.ledger, self.ops, self.overlap, self.sampler, self.runner = ledger, ops, overlap, sampler, runner
        self.requests = requests  # the engine's live requests (shared)
        self.eos_token_ids = eos_token_ids
        self.budget = budget  # the prefill budget its operations record
        self.forget = forget  # the engine drops a request that ended
        self.host_seconds = host_seconds

    def needs_values(self, step: LaunchedStep) -> bool:
        """Whether the step's bookkeeping must see its tokens: only when a row samples on the CPU.
        (A greedy request that may stop on a token is handled by a late stop instead.)"""
        for i in step.sampled:
            rec = self.requests.get(step.requests[i].uid)
            if rec is not None and not rec.params.is_greedy:
                return True
        return False

    def wait(self, step: LaunchedStep) -> None:
        t = time.perf_counter()
        with record_function("kvledger.wait"):
            if step.ready is not None:
                step.ready.synchronize()
        self.host_seconds["wait"] += time.perf_counter() - t

    def resolve(self, step: LaunchedStep) -> None:
        """Wait for the step's tokens; sample the non-greedy rows on the CPU."""
        self.wait(step)
        uids = [step.requests[i].uid for i in step.sampled]
        # a request that stopped late is still in this batch; its token is dropped: take the greedy one
        params = [rec.params if (rec := self.requests.get(u)) is not None else _GREEDY for u in uids]
        if all(p.is_greedy for p in params):
            step.values = step.host.tolist()
            return
        result = self.sampler.sample(step.logits, uids, params)  # greedy rows need no generator
        step.values, step.failed = result.tokens, result.failed
        self.runner.set_next_tokens([step.requests[i].table_idx for i in step.sampled], step.values)

    def complete(self, step: LaunchedStep) -> None:
        """The step's bookkeeping on the cache scheduler, with placeholder tokens if its own are
        not known yet."""
        reqs, values = step.requests, step.values
        sample = [0] * len(reqs)  # placeholders until the values are known
        if values is not None:
            for i, t in zip(step.sampled, values):
                sample[i] = t
        # a request whose sampling failed finishes here like a stop; its placeholder token is not output
        stop = (
            []
            if values is None
            else [
                reqs[i].uid
                for i, t in zip(step.sampled, values)
                if reqs[i].uid in self.requests and (reqs[i].uid in step.failed or self._stops(reqs[i].uid, t))
            ]
        )
        late = [reqs[i].uid for i in step.sampled if reqs[i].uid in self.overlap.late_stops]
        stop += late
        self.overlap.late_stops.difference_update(late)
        self.ledger.complete(reqs, sample, stop, step.batch.phase == "prefill")
        step.patch_at = [reqs[i].device_len - 1 for i in step.sampled]  # where append_host put it
        for i in step.sampled:
            req = reqs[i]
            if req.uid in step.failed:
                step.finished[req.uid] = "error"
            elif req.uid in stop:
                step.finished[req.uid] = "stop"
            elif not req.can_decode:
                step.finished[req.uid] = "length"
        for uid, reason in step.finished.items():
            rec = self.requests.get(uid)
            if rec is not None:  # None: it stopped late, and was delivered as finished already
                rec.finishing = reason
        record = step_record(
            step.batch.phase,
            self.budget,
            sample,
            stop,
            [r.uid for r in reqs],
            step.batch.preempted,
            self.ledger.preempts,
        )
        step.entry = self.ops.record(record, ready=values is not None)

    def land(self, step: LaunchedStep) -> List[TokenEvent]:
        """The step's tokens are known: patch placeholders, tell observers, emit the tokens."""
        started = time.perf_counter()
        if step.values is None:
            self.wait(step)
            step.values = step.host.tolist()
            self.overlap.patch_tokens(step)
            sample = list(step.entry.record.op.sample)
            for i, t in zip(step.sampled, step.values):
                sample[i] = t
            step.entry.fill_sample(sample)
            self.ops.flush()
        events = []
        for i, t in zip(step.sampled, step.values):
            uid = step.requests[i].uid
            reason = step.finished.get(uid)
            rec = self.requests.get(uid)
            if rec is None:  # aborted, or stopped late, while this step was in flight
                continue
            rec.finishing = None
            if reason == "length" and self._stops(uid, t):  # its last token is a stop token, as without overlap
                reason = "stop"
            elif reason is None and self._stops(uid, t):  # its step's bookkeeping ran before the value was known
                reason = "stop"
                self.overlap.stopped_late(uid)
            events.append(TokenEvent(uid, t, reason is not None, reason, step.failed.get(uid), rec.cached_tokens or 0))
            if reason is not None:
                self.forget(uid)
        self.host_seconds["land"] += time.perf_counter() - started
        return events

    def _stops(self, uid: int, token: int) -> bool:
        p = self.requests[uid].params
        return (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids
