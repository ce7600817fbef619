"""vLLM 0.33.0's real v1 `Scheduler` as a self-scheduling kvledger subject (`SchedulingSubject`).

Three specs, each a real `Scheduler` built by `vllm_scheduler_build.build_scheduler`:
  vllm:sched   the plain scheduler: prefix caching, chunked prefill, FCFS preemption
  vllm:spec    speculative decoding, EAGLE-style: K = 3 drafts verified per step and
               num_lookahead_tokens = 3 slots allocated past them (the over-allocation ngram,
               with lookahead 0, never makes)
  vllm:async   `AsyncScheduler`: step N+1 scheduled before step N's outputs (output placeholders)

The adapter plays EngineCore around the scheduler (`vllm/v1/engine/core.py`): `step` is
schedule -> execute_model -> update_from_output -> post_step (update_draft_token_ids), and
`step_with_batch_queue` keeps two batches in flight for async scheduling. The model is the
driver: it says what each scheduled request sampled (`Output`). Nothing here re-implements a
scheduling decision; `view()` reads the scheduler's own structures (`vllm_scheduler_view.py`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, Hashable, List, Optional, Sequence, Tuple

from kvledger.properties.scheduling_subject import Output, Plan, Scheduled
from kvledger.properties.subject import Capabilities, DriverMismatch, SubjectConfig, View
from kvledger.subjects import vllm as vllm_manager
from kvledger.subjects.edits import SourceEdit, bind_to_instances
from kvledger.subjects.installed import InstalledPackage
from kvledger.subjects.vllm_scheduler_build import FULL, Built, Group, Speculation, build_scheduler, import_vllm
from kvledger.subjects.vllm_scheduler_view import CacheKeys, scheduler_view
from kvledger.subjects.vllm_scheduler_zoo import ZOOS

__all__ = ["VARIANTS", "ZOOS", "VllmSchedulerSubject", "Variant", "build_spec", "probe"]

# vLLM infers its platform once, on first use, from the environment: a zoo edit compiled before
# any subject is built (edits.edited_function imports the scheduler module) must find it set
import_vllm()

NAME = "vllm"
VERSION = vllm_manager.VERSION
# the manager adapter's packages, and einops: ModelConfig imports vLLM's Llama module
PACKAGES: Tuple[str, ...] = (*vllm_manager.PACKAGES, "einops")
INSTALL = f"pip install --no-deps -c subjects-constraints.txt {' '.join(PACKAGES)}"


def _load() -> Any:
    import_vllm()  # the CPU platform, before vllm's first import
    v = vllm_manager.PACKAGE.load()
    importlib.import_module("einops")
    importlib.import_module("vllm.v1.core.sched.async_scheduler")
    return v


PACKAGE: InstalledPackage[Any] = InstalledPackage("vllm", VERSION, (*vllm_manager._MODULES, "einops"), INSTALL, _load)
SPEC_TOKENS = 3  # K of vllm:spec
LOOKAHEAD = 3  # vllm:spec's num_lookahead_tokens (EAGLE: = K)
ASYNC_DEPTH = 2  # EngineCore's max_concurrent_batches with async scheduling


@dataclass(frozen=True)
class Variant:
    """What one spec builds."""

    name: str
    speculative: Optional[Speculation] = None
    async_scheduling: bool = False
    groups: Tuple[Group, ...] = (FULL,)
    kv_transfer: Optional[Dict[str, Any]] = None  # KVTransferConfig's keyword arguments (a connector)


VARIANTS: Dict[str, Variant] = {
    "vllm:sched": Variant("vllm:sched"),
    "vllm:spec": Variant("vllm:spec", speculative=Speculation("eagle", SPEC_TOKENS)),
    "vllm:async": Variant("vllm:async", async_scheduling=True),
}


def probe(path: str | None = None) -> Tuple[bool, str, str]:
    return PACKAGE.probe()


def build_spec(config: SubjectConfig, spec: str, edits: Sequence[SourceEdit] = ()) -> "VllmSchedulerSubject":
    if spec not in VARIANTS:
        raise ValueError(f"{spec}: not one of {', '.join(VARIANTS)}")
    PACKAGE.load()
    return VllmSchedulerSubject(config, VARIANTS[spec], edits)


def _capabilities(config: SubjectConfig, variant: Variant, built: Built) -> Capabilities:
    s = built.scheduler
    k, lookahead = s.num_spec_tokens, s.num_lookahead_tokens
    # positions a request may hold slots for past its tokens: after schedule(), the K drafts
    # counted in num_computed_tokens plus the lookahead slots allocate_slots adds
    # (kv_cache_manager.py:380). Async scheduling's placeholders are not among them: they stand
    # for tokens the model has sampled (the driver knows them when the step runs), so the slots
    # they get are never past the request's tokens
    ahead = (k + lookahead) if k else 0
    return Capabilities(
        page_size=config.page_size,
        pages=tuple(range(1, config.num_pages + 1)),
        worst_case_admission=False,
        preempts=True,
        explicit_evict=False,
        cached_pages_in_free_pool=True,
        chunked_prefill=True,
        prefill_publishes_to_cache=True,
        schedules=True,
        in_flight=ASYNC_DEPTH if variant.async_scheduling else 1,
        spec_tokens=k,
        max_ahead=ahead,
        # FCFS resumes by arrival, but with a connector a request whose KV loaded joins `running`
        # when it is next scheduled (scheduler.py:1549), behind later arrivals admitted while it
        # loaded; preemption pops running[-1] and prepends it (:1842), so a later arrival can then
        # wait ahead of it: vLLM's order, not a promise of arrival order
        resume_order="any" if variant.kv_transfer else "admission",
    )


class VllmSchedulerSubject:
    """One real Scheduler and the EngineCore loop around it, driven by kvledger's model."""

    name = NAME

    def __init__(self, config: SubjectConfig, variant: Variant, edits: Sequence[SourceEdit] = ()) -> None:
        self.variant = variant
        self.version = importlib.metadata.version("vllm")
        self.block_size = bs = config.page_size
        self.built = build_scheduler(
            config,
            groups=variant.groups,
            speculative=variant.speculative,
            kv_transfer=variant.kv_transfer,
            async_scheduling=variant.async_scheduling,
        )
        self.scheduler = self.built.scheduler
        self.capabilities = _capabilities(config, variant, self.built)
        self.groups = variant.groups
        self.v = v = PACKAGE.load()
        # EngineCore builds each Request with this hasher (hash_block_size = the block size here)
        self._block_hasher = v.kv_cache_utils.get_request_block_hasher(bs, v.sha256)
        self.keys = CacheKeys(bs)
        self._bind(edits)
        self._watch()
        self.in_flight: Deque[Any] = deque()  # SchedulerOutputs scheduled, outputs not yet delivered
        self.default_budget: int = self.scheduler.max_num_scheduled_tokens

    # -- zoo edits and the two observers ----------------------------------------------------------
    def _owners(self) -> Tuple[Any, ...]:
        mgr = self.scheduler.kv_cache_manager
        pool = mgr.block_pool
        return (
            self.scheduler,
            mgr,
            mgr.coordinator,
            *mgr.coordinator.single_type_managers,
            pool,
            pool.free_block_queue,
            pool.cached_block_hash_to_block,
        )

    def _bind(self, edits: Sequence[SourceEdit]) -> None:
        """Each edit on the objects of this scheduler that run the target's method."""
        owners = self._owners()
        bind_to_instances(edits, owners, "Scheduler")

    def _watch(self) -> None:
        """Record, without changing them, two facts schedule() keeps in locals: the order it
        preempts in (`_preempt_request` calls), and a waiting request allocate_slots refused."""
        s, mgr = self.scheduler, self.scheduler.kv_cache_manager
        preempt, allocate = s._preempt_request, mgr.allocate_slots
        self._preempted: List[int] = []
        self._refused: Optional[int] = None
        waiting = (self.v.RequestStatus.WAITING, self.v.RequestStatus.PREEMPTED)

        def preempt_request(request: Any, *args: Any, **kwargs: Any) -> Any:
            self._preempted.append(int(request.request_id))
            return preempt(request, *args, **kwargs)

        def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
            blocks = allocate(request, *args, **kwargs)
            if blocks is None and request.status in waiting:
                self._refused = int(request.request_id)
            return blocks

        s._preempt_request = preempt_request
        mgr.allocate_slots = allocate_slots

    # -- the protocol ---------------------------------------------------------------------------
    def submit(self, uid: int, prompt: Sequence[int], max_tokens: int) -> None:
        # EngineCore.add_request: the Request with its block hasher (every full prompt block is
        # hashed now), then Scheduler.add_request (the waiting queue's tail). arrival_time is the
        # uid so that nothing depends on the clock (FCFS orders by queue position anyway).
        request = self.v.Request(
            str(uid),
            [int(t) for t in prompt],
            self.v.SamplingParams(max_tokens=max_tokens),
            None,
            arrival_time=float(uid),
            block_hasher=self._block_hasher,
        )
        self.scheduler.add_request(request)

    def schedule(self, budget: Optional[int]) -> Plan:
        s = self.scheduler
        running = {r.request_id for r in s.running}
        self._preempted, self._refused = [], None
        # the step's token budget: Scheduler.schedule starts from max_num_scheduled_tokens
        s.max_num_scheduled_tokens = self.default_budget if budget is None else budget
        try:
            out = s.schedule()
        finally:
            s.max_num_scheduled_tokens = self.default_budget
        self.in_flight.append(out)
        scheduled = []
        # num_scheduled_tokens is filled running loop first, then the waiting loop: the batch order
        for req_id, n in out.num_scheduled_tokens.items():
            request = s.requests[req_id]
            # _update_after_schedule advanced num_computed_tokens by n already
            start = request.num_computed_tokens - n
            # drafts, or pad_spec_decode's -1 pads for a request admitted ready to decode
            # (scheduler.py:1578): positions scheduled like drafts, which no model accepts
            drafts = tuple(int(t) for t in out.scheduled_spec_decode_tokens.get(req_id, ()))
            admitted = req_id not in running
            scheduled.append(
                Scheduled(
                    uid=int(req_id),
                    start=start,
                    end=start + n - len(drafts),
                    drafts=drafts,
                    hit=start if admitted else None,
                    external=int(getattr(request, "num_external_computed_tokens", 0) or 0) if admitted else 0,
                )
            )
        return Plan(scheduled=tuple(scheduled), preempted=tuple(self._preempted), refused=self._refused)

    def output(self, outputs: Dict[int, Output], loaded: Sequence[int] = ()) -> None:
        from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

        if not self.in_flight:
            raise DriverMismatch("output() with no step in flight")
        out = self.in_flight.popleft()
        s = self.scheduler
        ids = list(out.num_scheduled_tokens)
        sampled: List[List[int]] = []
        stops: List[str] = []
        for req_id in ids:
            given = outputs.get(int(req_id))
            tokens = [int(t) for t in given.tokens] if given is not None else []
            sampled.append(tokens)
            if given is not None and given.stop and tokens:
                request = s.requests.get(req_id)
                if request is not None and tokens[-1] not in tokens[:-1]:
                    # the stop is the model sampling a stop token: check_stop in
                    # _update_request_with_output (scheduler.py:2757) ends it, FINISHED_STOPPED
                    request.sampling_params.stop_token_ids = [tokens[-1]]
                else:
                    stops.append(req_id)  # its value occurs earlier in this output: ended below
        index = {r: i for i, r in enumerate(ids)}
        s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index=index, sampled_token_ids=sampled))
        if stops:
            s.finish_requests(stops, self.v.RequestStatus.FINISHED_STOPPED)
        if self.capabilities.spec_tokens and not self.variant.async_scheduling:
            # EngineCore.post_step (core.py:699): the drafter's proposals for the step's batch
            drafts = [[int(t) for t in outputs[int(r)].drafts] if int(r) in outputs else [] for r in ids]
            s.update_draft_token_ids(DraftTokenIds(req_ids=ids, draft_token_ids=drafts))

    def finish(self, uid: int) -> None:
        # a stop string: the output processor finds it after detokenizing and EngineCore aborts
        # the request (EngineCore.abort_requests, core.py:564: finish_requests FINISHED_ABORTED)
        self.scheduler.finish_requests(str(uid), self.v.RequestStatus.FINISHED_ABORTED)

    def abort(self, uid: int) -> None:
        # the client went away: the same call (finish_requests frees what it holds, queued or running)
        self.scheduler.finish_requests(str(uid), self.v.RequestStatus.FINISHED_ABORTED)

    def view(self) -> View:
        return scheduler_view(self.scheduler, self.block_size, self.groups)

    def cache_key(self, tokens: Sequence[int], group: int = 0) -> Hashable:
        return self.keys.key(tokens, group)
