"""`sglang:paged`: SGLang 0.5.23's default tree cache at page size > 1, with its scheduler's decode
memory check and retraction, in the scheduler's order (the rest is `sglang.py`'s SglangSubject).

Each decode step SGLang's `Scheduler.update_running_batch` (scheduler.py:4459) asks the running
batch whether the step fits, `ScheduleBatch.check_decode_mem` (schedule_batch.py:3432): a page for
each request whose committed length sits on a page boundary (`new_tokens_required_next_decode`,
:3403), checked by the allocator after evicting (`check_decode_capacity`, allocator/base.py:171).
When it does not fit, `retract_decode` (:3451) pops requests from the end of
`_get_decode_retraction_order` (:3540: fewest output tokens, then longest prompt, go first) until
the rest fits, always keeping one, and releases each (`release_req`, :2359:
`release_kv_cache(checkpoint=False)`, an eviction for the remaining requests' next
SGLANG_RETRACT_DECODE_STEPS tokens, `reset_for_retract`); the scheduler keeps the new_token_ratio
it returns (`new_token_ratio_tracker.current`, :4513) and requeues the retracted requests. Then
`prepare_for_decode` -> `alloc_for_decode` allocates for the whole batch.

The adapter makes those calls on a ScheduleBatch of the running requests (in admission order:
`get_next_batch_to_run` merges each prefill batch at the running batch's end) at the first decode
allocation of a step. When the step fits, `alloc_for_decode` runs for every running request at
once, and the driver's other allocations of the step find theirs done. When it does not,
`retract_decode` itself runs and the allocation answers False; the subject chooses the victims
(`Capabilities.chooses_victim`): `victim` names the requests `retract_decode` released, in its
order, and `preempt` only requeues each. Where the protocol makes it differ from SGLang: the last
request, which `retract_decode` ends when even it alone does not fit (its `reqs_to_abort`: another
request mid-prefill holds the rest of the pool), SGLang answers with an abort; the driver requeues
it as a retracted one, so the adapter drops its pending FINISH_ABORT and it resumes as one.

The deployment (`PAGED_KNOBS`, real environment knobs of SGLang's scheduler process, read where
SGLang reads them): SGLANG_INIT_NEW_TOKEN_RATIO 0.05 (`NewTokenRatioTracker.from_config`, at the
scheduler's start) and SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION 2 (`schedule_policy.CLIP_MAX_NEW_TOKENS`,
at its import), as a deployment that trusts its requests to stop early sets them. The PrefillAdder
then charges each request at most 2 decode tokens, and a running one a twentieth of those, so a
small pool fills in decode: a step that needs a new page on a pool with no free or evictable page,
and the retraction that answers it.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Dict, Iterator, List, Sequence, Tuple

from kvledger.properties.subject import Capabilities, DriverMismatch, SubjectConfig
from kvledger.subjects.edits import SourceEdit
from kvledger.subjects.sglang import SglangSubject, load
from kvledger.subjects.sglang_import import ALLOCATION, PACKAGE, VERSION
from kvledger.subjects.sglang_paged_zoo import ZOO
from kvledger.subjects.sglang_scheduler import SchedulerState

__all__ = ["MIN_PAGE_SIZE", "NAME", "PAGED_KNOBS", "VERSION", "ZOO", "PagedSglangSubject", "build", "probe"]

NAME = "sglang:paged"
MIN_PAGE_SIZE = 2  # the spec is page size > 1 (`kvledger.subjects.SubjectSpec.page_sizes`)
# SGLang's environment knobs this deployment sets, read where SGLang reads them (its `envs`)
PAGED_KNOBS: Dict[str, str] = {"SGLANG_INIT_NEW_TOKEN_RATIO": "0.05", "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "2"}


def probe(path: str | None = None) -> Tuple[bool, str, str]:
    return PACKAGE.probe()


def build(config: SubjectConfig, path: str | None = None, edits: Sequence[SourceEdit] = ()) -> "PagedSglangSubject":
    PACKAGE.no_path(path)
    if config.page_size < MIN_PAGE_SIZE:
        raise ValueError(f"{NAME}: page size {config.page_size}, the spec is page size >= {MIN_PAGE_SIZE}")
    return PagedSglangSubject(config, load(), edits)


@contextlib.contextmanager
def knobs(envs: Any, values: Dict[str, str]) -> Iterator[None]:
    """SGLang's env knobs `values` set while the block runs (EnvField.override), as in a process
    started with them."""
    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            stack.enter_context(getattr(envs, name).override(value))
        yield


class PagedSglangSubject(SglangSubject):
    """The running batch's decode memory check and retraction, by SGLang's own calls."""

    name = NAME

    def __init__(self, config: SubjectConfig, s: Any, edits: Sequence[SourceEdit] = ()) -> None:
        # this step's decode: the uids alloc_for_decode served, the requests retract_decode
        # released and the driver has not yet been told of, whether the step was checked
        self._decoded: set[int] = set()
        self._retracted: List[int] = []
        self._checked = False
        super().__init__(config, s, edits)

    def build_scheduler_state(self) -> SchedulerState:
        with knobs(self.s.envs, PAGED_KNOBS):
            state = SchedulerState(self.s)
            # schedule_policy reads this knob once, at its import: as in a process started with it
            state.clip = self.s.envs.SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION.get()
        return state

    def build_capabilities(self, config: SubjectConfig) -> Capabilities:
        caps = super().build_capabilities(config)
        return Capabilities(**{**caps.__dict__, "chooses_victim": True})

    def begin(self, kind: str, uid: int, call: str) -> bool:
        started = super().begin(kind, uid, call)
        if started:
            self._decoded, self._retracted, self._checked = set(), [], False
        return started

    def allocate(self, uid: int, start: int, end: int) -> bool:
        if uid in self._retracted:
            # retract_decode released it at this step's memory check, which the driver learns only
            # as a refusal: no room for it, and `victim` names it (it may be a later request of
            # the batch than the one whose allocation ran the check)
            return False
        return super().allocate(uid, start, end)

    def _allocate_decode(self, uid: int, req: Any, start: int, end: int) -> bool:
        self.begin("decode", uid, "allocate")
        done = uid in self._decoded
        committed = req.kv.kv_committed_len - (1 if done else 0)
        if start != committed or end != start + 1:
            raise DriverMismatch(f"uid {uid}: decode [{start}, {end}) with {committed} positions holding KV")
        if done:
            return True  # alloc_for_decode served the whole batch at the step's first allocation
        if self._retracted:  # retract_decode's victims, not yet named to the driver
            self.scheduler.retry(uid, "allocate")
            return False
        batch = self._running_batch()
        if not self._checked:
            self._checked = True
            # update_running_batch: check_decode_mem, and retract_decode when it does not fit
            if not batch.check_decode_mem():
                self._retract(batch)
                self.scheduler.retry(uid, "allocate")
                return False
        # prepare_for_decode -> alloc_for_decode(batch, token_per_req=1), the whole batch
        self.functions[f"{ALLOCATION}:alloc_for_decode"](batch, 1)
        self._decoded = {u for u, r in self.requests.items() if r.phase == "running"}
        return True

    def _retract(self, batch: Any) -> None:
        """retract_decode and what update_running_batch keeps of its answer (scheduler.py:4459):
        the new_token_ratio, and the released requests, to be requeued."""
        retracted, ratio, aborted = batch.retract_decode()
        self.scheduler.ratio.current = ratio
        for req in aborted:
            # the last request, which retract_decode ends when even it alone does not fit
            # (to_finish = FINISH_ABORT, schedule_batch.py:3515; SGLang sends its abort output at
            # scheduler.py:4514 and never requeues it): release_req released it as a retraction, and
            # the driver requeues it as one, so it resumes without the abort. Left, its resumed
            # prefill's update_finish_state would finish it: the prompt not checkpointed into the
            # tree (computed), and the request decoding on as a finished one
            req.to_finish = None
        by_req = {id(r.req): u for u, r in self.requests.items()}
        self._retracted = [by_req[id(r)] for r in (*retracted, *aborted)]
        for victim in self._retracted:
            self.requests[victim].phase = "retracted"

    def _running_batch(self) -> Any:
        torch = self.s.torch
        reqs = [r.req for r in self._running()]
        batch = self.batch_of(reqs)
        lens = [r.kv.kv_committed_len for r in reqs]
        rows = [r.kv.req_pool_idx for r in reqs]
        batch.seq_lens = batch.seq_lens_cpu = torch.tensor(lens, dtype=torch.int64)
        batch.orig_seq_lens = torch.tensor(lens, dtype=torch.int32)
        batch.req_pool_indices = batch.req_pool_indices_cpu = torch.tensor(rows, dtype=torch.int64)
        # the batch's sampling state, which retract_decode's filter_batch narrows and the cache
        # never reads (a model's: SamplingBatchInfo.from_schedule_batch)
        batch.sampling_info = types.SimpleNamespace(filter_batch=lambda keep, keep_device: None)
        return batch

    def victim(self, uid: int) -> int:
        """The next request retract_decode released, in its order. Without a retraction (an
        allocation of a prefill chunk found no room, which SGLang's PrefillAdder would not have
        scheduled), the newest live request, as the driver would give up."""
        if self._retracted:
            return self._retracted[0]
        live = [(r.order, u) for u, r in self.requests.items() if r.phase in ("admitted", "running")]
        return max(live)[1]

    def preempt(self, uid: int) -> None:
        if uid in self._retracted:
            # released by retract_decode; Scheduler.update_running_batch requeues it
            # (_add_request_to_queue(req, is_retracted=True))
            self._retracted.remove(uid)
            self.requests[uid].phase = "waiting"
            self.scheduler.forget(uid)
            return
        super().preempt(uid)
