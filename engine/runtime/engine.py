"""The engine: requests in, tokens out, one step at a time, on the `fast` cache manager.

    engine.add_request(token_ids, params) -> uid
    engine.step() -> [TokenEvent]          schedule -> run the model -> sample -> complete -> land
    engine.abort(uid)

`LLM`, the server's worker and every benchmark drive this class. `step` reads top to bottom: it
chooses a batch (`scheduler.py`) and runs the model over the page table (`model_runner.py`), then
samples and completes the step on the cache scheduler (`postprocess.py`: finishes in one
lazy-free region, `cache_req` after prefill and at finish), and lands the tokens: the request
records (`requests.py`) turn them into events and say which requests ended, which the engine
then drops. Every cache-side step is one typed operation (`OpRecord`) of the trace format, told
to the observers (trace recorder, shadow verifier) in order (`op_stream.py`). With overlap
(`overlap.py`) step N+1 is launched before step N's tokens reach the host, and step N lands in
step N+1. Each collaborator keeps its own state; none calls back into the engine.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Dict, Iterable, List, Optional, Sequence

import torch

from kvledger import fast
from kvledger.engine.engine_config import ResolvedConfig
from kvledger.engine.ledger.cache_scheduler import CacheScheduler, PageStats
from kvledger.engine.ledger.observer import Observer
from kvledger.engine.ledger.ops import Abort, CacheOp, Evict, Finish, OpRecord, Submit
from kvledger.engine.model.model import CausalLM
from kvledger.engine.runtime.faults import RANK_KINDS, FaultPlan, InjectedFault
from kvledger.engine.runtime.host_ranges import host_range
from kvledger.engine.runtime.model_runner import ModelRunner
from kvledger.engine.runtime.op_stream import OpStream
from kvledger.engine.runtime.overlap import LaunchedStep, Overlap
from kvledger.engine.runtime.postprocess import Postprocessor
from kvledger.engine.runtime.prefix_sharing import PrefixSharing
from kvledger.engine.runtime.requests import RequestLimits, Requests, TokenEvent
from kvledger.engine.runtime.sampling import Sampler
from kvledger.engine.runtime.scheduler import Batch, Scheduler
from kvledger.engine.runtime.step_errors import FORWARD_ERROR, contains, failed_step, unsampled
from kvledger.engine.runtime.step_faults import StepFaults, describe_batch

__all__ = ["Engine", "TokenEvent"]

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        model: CausalLM,
        config: ResolvedConfig,
        eos_token_ids: Iterable[int] = (),
        device: str | torch.device = "cpu",
        overlap: Optional[bool] = None,
        cuda_graphs: bool = True,
        contain_errors: bool = True,
    ) -> None:
        """`contain_errors`: a forward pass that raises ends only its step's requests (step_errors.py);
        False on tensor-parallel ranks, where only injected errors are contained."""
        self.model = model
        self.config = config
        self.device = torch.device(device)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.header = config.trace_header()
        self.cache_scheduler = CacheScheduler(
            fast,
            device=str(self.device),
            check_admission=False,
            increasing_uids=True,
            track_provenance=False,
            **self.header.cache_scheduler_args(),
        )
        self.limits = RequestLimits(config.max_seq_len, model.config.vocab_size, config.page_size, config.pool_tokens)
        self.ops = OpStream(self.cache_scheduler)
        self.scheduler = Scheduler(self.cache_scheduler, self.ops, config.max_prefill_tokens)
        self.runner = ModelRunner(
            model, self.cache_scheduler.page_table, config.max_running_req, self.device, cuda_graphs
        )
        self.sampler = Sampler(config.seed)
        self.post = Postprocessor(self.cache_scheduler, self.ops, self.sampler, self.runner, config.max_prefill_tokens)
        self.overlap = Overlap(self.device.type == "cuda" if overlap is None else overlap)
        # whether running requests may share KV pages: decode replays the cascade-attention graphs
        # only then (a workload without shared prefixes pays nothing for them)
        self.prefix_sharing = PrefixSharing()
        self.requests = Requests(self.eos_token_ids)  # the live requests
        # host seconds per part of step() (schedule includes launching the GPU work; wait is the
        # host blocked on the GPU), and steps per phase: benchmarks report them
        self.host_seconds: Dict[str, float] = {"schedule": 0.0, "complete": 0.0, "land": 0.0, "wait": 0.0}
        self.steps: Dict[str, int] = {"prefill": 0, "decode": 0}
        self.batch: Optional[Batch] = None  # the batch of the step in progress (the watchdog's dump)
        # injected faults (--inject-fault, $KVLEDGER_INJECT_FAULT): None, and free, unless set
        # (the rank kinds are the tensor-parallel ranks': engine/distributed/rank_faults.py)
        plan = FaultPlan.parse(config.inject_fault) if config.inject_fault else None
        in_steps = plan is not None and plan.kinds - RANK_KINDS
        self.faults = StepFaults(self, plan, partial(Engine.abort, self)) if plan is not None and in_steps else None
        self.contain_errors = contain_errors
        self.contained: Dict[str, int] = {}  # forward errors nobody injected that the engine contained, by kind

    # -- what callers read --------------------------------------------------------------------
    @property
    def observers(self) -> List[Observer]:
        return self.ops.observers

    @property
    def operations(self) -> int:
        """Cache operations performed and told to every observer."""
        return self.ops.delivered

    @property
    def graphs(self):
        """The decode CUDA graphs (None without them)."""
        return self.runner.graphs

    @property
    def late_stops(self) -> int:
        return self.overlap.late_stop_count

    @property
    def sharing_possible(self) -> bool:
        """Whether running requests may share KV pages (`PrefixSharing`): decode then uses cascade
        attention."""
        return self.prefix_sharing.possible

    @property
    def has_work(self) -> bool:
        cache = self.cache_scheduler
        return bool(cache.queue_length() or cache.has_runnable() or self.overlap.inflight is not None)

    @property
    def waiting_requests(self) -> int:
        """Requests submitted and not admitted yet (preempted ones included)."""
        return self.cache_scheduler.queue_length()

    @property
    def running_requests(self) -> int:
        return len(self.cache_scheduler.running_requests())

    @property
    def preemptions(self) -> int:
        return self.cache_scheduler.preemptions

    @property
    def recomputed_tokens(self) -> int:
        """KV positions computed again after a preemption (not found in the prefix cache)."""
        return self.cache_scheduler.recomputed_tokens

    def page_stats(self) -> PageStats:
        return self.cache_scheduler.page_stats()

    def describe(self) -> str:
        """The step in progress and the ledger's state, for a log (the watchdog's dump)."""
        pages = self.page_stats()
        return (
            f"{describe_batch(self.batch)}\nledger: {self.running_requests} running, {self.waiting_requests} waiting; "
            f"pages {pages.total} total, {pages.free} free, {pages.cached} cached, {pages.owned} owned by live "
            f"requests, {pages.locked_tokens} cached tokens locked; {self.operations} cache operations"
        )

    def next_uid(self) -> int:
        """A uid no request of this engine has used (uids increase)."""
        return self.cache_scheduler.next_uid()

    def capture_graphs(self) -> None:
        self.runner.capture_graphs()

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, token_ids: Sequence[int], params: fast.SamplingParams, uid: Optional[int] = None) -> int:
        """Queue a request; returns its uid (the next free one unless given). Raises RequestError
        naming the field if it can never run, and nothing is queued then."""
        uid = self.next_uid() if uid is None else uid
        ids = list(map(int, token_ids))
        self.limits.validate(ids, params)
        self.requests.add(uid, params)
        self.sampler.add(uid, params)
        self._do(Submit(uid, tuple(ids), params.max_tokens))
        return uid

    def abort(self, uid: int) -> None:
        """Drop a waiting or running request and free its slot and pages at once."""
        rec = self.requests.get(uid)
        if rec is not None and rec.finishing is not None:  # released by its last step, tokens not delivered
            self._forget(uid)
            return
        self._do(Abort(uid))
        self._forget(uid)

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> List[TokenEvent]:
        """Launch the next batch, then deliver the tokens of the previous one (with overlap) or of
        this one (without). Returns the delivered tokens."""
        events: List[TokenEvent] = []
        clock = time.perf_counter
        t0 = clock()
        launched = self._launch()  # schedule, run the model
        self.host_seconds["schedule"] += clock() - t0
        previous = self.overlap.take_inflight()
        if previous is not None:  # launched by the last step, completed on placeholders: it lands now
            events += self._land(previous)
        if launched is not None:
            self.steps[launched.batch.phase] += 1
            failed = launched.error is not None
            wait = (
                failed or not self.overlap.enabled or self.requests.sample_on_cpu(launched.requests, launched.sampled)
            )
            if wait and not failed:
                self._wait(launched)
                self.post.sample(launched, self.requests.sampling_params(launched.sampled_uids()))
            t2 = clock()
            with host_range("kvledger.complete"):
                self._complete(launched)
            self.host_seconds["complete"] += clock() - t2
            if wait:
                events += self._land(launched)
            else:
                self.overlap.hold(launched)
            if failed:
                events += self._clean_up_failed(launched)
        for uid in self.overlap.pop_late_stops():  # not in this step's batch (a prefill, or it was preempted)
            self._do(Finish(uid) if self.cache_scheduler.is_running(uid) else Abort(uid))
        if self.faults is not None:  # the requests a contained fault ended, with their errors
            events += self.faults.take_ended()
        self.batch = None
        if not self.has_work:
            self.check_idle()
        return events

    def check_idle(self) -> None:
        """With nothing live: every page is free or cached, no lock held, and the partition holds
        (the judge, then the implementation's own integrity check: `CacheScheduler.check`)."""
        if not self.cache_scheduler.live and self.overlap.inflight is None:
            self.cache_scheduler.check()

    # -- the parts of a step ------------------------------------------------------------------
    def _launch(self) -> Optional[LaunchedStep]:
        """Schedule the next batch and launch the model on it; on CUDA its greedy tokens are
        copied to pinned host memory without waiting."""
        with host_range("kvledger.schedule"):
            if self.faults is not None:  # faults injected: the step may fail on purpose (step_faults.py)
                return self.faults.launch(self._schedule, self._run_contained)
            batch = self._schedule()
            return None if batch is None else self._run_contained(batch)

    def _schedule(self) -> Optional[Batch]:
        """The next batch with its pages, or None when it computes nothing."""
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        self._admitted(batch)
        if batch.preempted:
            self.overlap.note_preempted(batch.preempted, self.cache_scheduler)
        if not batch.requests:  # every request of the step was preempted: nothing to compute
            return None
        self.batch = batch
        return batch

    def _run_contained(self, batch: Batch) -> LaunchedStep:
        """Run the model; a forward pass that raises an error the engine contains gives a failed step."""
        try:
            if self.faults is not None:
                self.faults.forward(batch)  # an injected forward-raise raises here, as a real error would
            return self._run_model(batch)
        except Exception as error:
            if not contains(error, self.contain_errors):
                raise
            injected = isinstance(error, InjectedFault)  # counted where it struck; its traceback says nothing
            if not injected:
                self.contained[FORWARD_ERROR] = self.contained.get(FORWARD_ERROR, 0) + 1
            trace = None if injected else error
            log.error("%s; ending its batch's requests\n%s", error, describe_batch(batch), exc_info=trace)
            return failed_step(batch, error)

    def _run_model(self, batch: Batch) -> LaunchedStep:
        logits, tokens = self.runner.forward(batch, self.sharing_possible)
        if self.device.type != "cuda":
            return LaunchedStep(batch, logits, tokens)
        step = LaunchedStep(batch, logits, torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True))
        step.host.copy_(tokens, non_blocking=True)
        step.ready = torch.cuda.Event()
        step.ready.record()
        return step

    def _admitted(self, batch: Batch) -> None:
        for req, cached_len in batch.admitted:
            self.requests.admitted(req.uid, cached_len)
            if req.uid in batch.hits:  # admitted now, not a later chunk
                self.prefix_sharing.admitted(req.uid, req.input_ids, batch.hits[req.uid])

    def _wait(self, step: LaunchedStep) -> None:
        t = time.perf_counter()
        step.wait()
        self.host_seconds["wait"] += time.perf_counter() - t

    def _complete(self, step: LaunchedStep) -> None:
        """The step's bookkeeping on the cache scheduler. It releases the requests whose token
        stops them (when its tokens are known) and the late stops among its rows."""
        values = step.values
        stop = [] if values is None else self.requests.stopped(step.requests, step.sampled, values, step.failed)
        stop += self.overlap.take_late_stops(step)
        self.post.complete(step, stop)
        self.requests.finishing(step.finished)

    def _land(self, step: LaunchedStep) -> List[TokenEvent]:
        """The step's tokens are known: patch the placeholders and tell the observers (overlap),
        then deliver the tokens and drop the requests that ended."""
        started = time.perf_counter()
        if step.values is None:  # completed on placeholders
            self._wait(step)
            step.values = step.host.tolist()
            self.overlap.patch_tokens(step)
            self.post.release(step)
        delivered = self.requests.deliver(step.requests, step.sampled, step.values, step.finished, step.failed)
        for uid in delivered.stopped_late:
            self.overlap.stopped_late(uid)
        for uid in delivered.ended:
            self._forget(uid)
        self.host_seconds["land"] += time.perf_counter() - started
        return delivered.events

    def _clean_up_failed(self, step: LaunchedStep) -> List[TokenEvent]:
        """After a failed step completed and its sampled rows ended: abort its other rows, drop
        the prefix cache's unheld entries (the failed pass may have left their KV unwritten), and
        let the ledger's check witness the state (step_errors.py). Returns the aborted rows' errors."""
        events = []
        for uid in unsampled(step):
            rec = self.requests.get(uid)
            if rec is not None:
                events.append(TokenEvent(uid, 0, True, "error", step.error, rec.cached_tokens or 0))
                Engine.abort(self, uid)  # every tensor-parallel rank contains the step alike: none is told
        evictable = self.cache_scheduler.evictable_tokens()
        if evictable:
            self._do(Evict(evictable))
        self.cache_scheduler.check()
        return events

    # -- operations outside a step ------------------------------------------------------------
    def _do(self, op: CacheOp) -> None:
        self.cache_scheduler.apply(op)
        self.ops.record(OpRecord(op))

    def _forget(self, uid: int) -> None:
        self.requests.forget(uid)
        self.prefix_sharing.forget(uid)
        self.overlap.forget(uid)
        self.sampler.remove(uid)
