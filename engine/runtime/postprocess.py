"""After a batch's forward pass: its tokens, the cache scheduler's bookkeeping, the token events.

`resolve` waits for the tokens and samples the non-greedy rows on the CPU; `complete` runs the
step's bookkeeping on the cache scheduler (with placeholder tokens under overlap) and queues its
operation for the observers; `land` patches the placeholders once the tokens are known, finishes
requests that stopped, and returns the delivered tokens.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Set

from kvledger import fast
from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.engine.runtime.host_ranges import host_range
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
        cpu_sampled: Set[int],
        budget: int,
        forget: Callable[[int], None],
        host_seconds: Dict[str, float],
    ) -> None:
        self.ledger, self.ops, self.overlap, self.sampler, self.runner = ledger, ops, overlap, sampler, runner
        self.requests = requests  # the engine's live requests (shared)
        self.cpu_sampled = cpu_sampled  # the live ones that sample on the CPU (shared)
        self.budget = budget  # the prefill budget its operations record
        self.forget = forget  # the engine drops a request that ended
        self.host_seconds = host_seconds

    def needs_values(self, step: LaunchedStep) -> bool:
        """Whether the step's bookkeeping must see its tokens: only when a row samples on the CPU.
        (A greedy request that may stop on a token is handled by a late stop instead.)"""
        cpu = self.cpu_sampled
        if not cpu:  # all greedy, as in the throughput benchmarks: no per-row look
            return False
        reqs = step.requests
        return any(reqs[i].uid in cpu for i in step.sampled)

    def wait(self, step: LaunchedStep) -> None:
        t = time.perf_counter()
        with host_range("kvledger.wait"):
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
        stop = []
        if values is not None:
            for i, t in zip(step.sampled, values):
                rec = self.requests.get(reqs[i].uid)
                if rec is not None and (rec.uid in step.failed or t in rec.stop_ids):
                    stop.append(rec.uid)
        late_stops = self.overlap.late_stops
        late = [reqs[i].uid for i in step.sampled if reqs[i].uid in late_stops] if late_stops else []
        stop += late
        late_stops.difference_update(late)
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
        reqs, finished, failed, live = step.requests, step.finished, step.failed, self.requests
        for i, t in zip(step.sampled, step.values):
            uid = reqs[i].uid
            rec = live.get(uid)
            if rec is None:  # aborted, or stopped late, while this step was in flight
                continue
            reason = finished.get(uid)
            rec.finishing = None
            if t in rec.stop_ids:
                if reason is None:  # its step's bookkeeping ran before the value was known
                    self.overlap.stopped_late(uid)
                    reason = "stop"
                elif reason == "length":  # its last token is a stop token, as without overlap
                    reason = "stop"
            events.append(TokenEvent(uid, t, reason is not None, reason, failed.get(uid), rec.cached_tokens or 0))
            if reason is not None:
                self.forget(uid)
        self.host_seconds["land"] += time.perf_counter() - started
        return events
