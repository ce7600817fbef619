"""Overlap: step N+1 is scheduled and launched while the GPU still runs step N.

Sampled tokens stay on the device (the model runner's `next_tokens`, one entry per table row,
feeds the next decode step). Step N's bookkeeping (`CacheScheduler.complete`) runs right after its
launch with placeholder tokens; the real tokens are patched into the requests' host ids one step
later, before any cache operation reads them (a finishing request's KV ends at the token of the
step before). A greedy request whose token turns out to be a stop token (EOS, a stop id) is a
*late stop*: its tokens are delivered up to the stop, it is already in step N+1 (one wasted
token) and is released by step N+1's bookkeeping, or by a `finish` operation right after it when
N+1 was a prefill. Only steps that sample on the CPU wait for their tokens.

The cache operations are a valid serial schedule either way: a trace recorded with overlap replays
on both implementations (with EOS ignored it is exactly the serial trace), and the shadow
verifier checks the overlapped sequence itself (`op_stream.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Set

import torch

from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.engine.runtime.host_ranges import host_range
from kvledger.engine.runtime.op_stream import PendingOp
from kvledger.engine.runtime.scheduler import Batch


@dataclass
class LaunchedStep:
    """One launched batch, until its tokens are known on the host."""

    batch: Batch
    logits: torch.Tensor  # [len(sampled), vocab] on the device
    host: torch.Tensor  # greedy tokens of the sampled rows on the host (copied non-blocking on CUDA)
    ready: Optional[torch.cuda.Event] = None
    values: Optional[List[int]] = None  # sampled tokens, once known
    entry: Optional[PendingOp] = None  # its operation in the observers' queue
    patch_at: List[int] = field(default_factory=list)  # per sampled row: its placeholder's index in input_ids
    finished: Dict[int, Optional[str]] = field(default_factory=dict)  # uid -> finish reason
    failed: Dict[int, str] = field(default_factory=dict)  # uid -> why sampling failed for that request alone
    error: Optional[str] = None  # why its forward pass failed (step_errors.py): every row failed

    @property
    def requests(self) -> List[Any]:
        return self.batch.requests

    @property
    def sampled(self) -> List[int]:
        return self.batch.sampled

    def sampled_uids(self) -> List[int]:
        reqs = self.batch.requests
        return [reqs[i].uid for i in self.batch.sampled]

    def tokens(self) -> List[int]:
        """The sampled tokens, which are known once the step completed (or landed, with overlap)."""
        if self.values is None:
            raise RuntimeError("the step's tokens are not known yet")
        return self.values

    def operation(self) -> PendingOp:
        """Its operation in the observers' queue, which postprocessing records."""
        if self.entry is None:
            raise RuntimeError("the step's operation was not recorded")
        return self.entry

    def wait(self) -> None:
        """Block until its tokens are on the host (off CUDA they are there already)."""
        with host_range("kvledger.wait"):
            if self.ready is not None:
                self.ready.synchronize()


class Overlap:
    """The bookkeeping overlap needs between one step's launch and its tokens' arrival."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.inflight: Optional[LaunchedStep] = None
        # greedy requests that sampled a stop token in a step whose bookkeeping ran on placeholders
        self._late_stops: Set[int] = set()
        self.late_stop_count = 0  # how many requests finished that way (one wasted token each)
        # requests preempted while the step that sampled their last token was in flight: uid -> the
        # waiting request whose last token is still a placeholder (patched when that step lands)
        self._resumed: Dict[int, Any] = {}

    def hold(self, step: LaunchedStep) -> None:
        """The step's bookkeeping ran on placeholders: its tokens land in the next step."""
        self.inflight = step

    def take_inflight(self) -> Optional[LaunchedStep]:
        step, self.inflight = self.inflight, None
        return step

    def note_preempted(self, uids: Iterable[int], cache_scheduler: CacheScheduler) -> None:
        """Victims whose last token the in-flight step has not delivered yet resume from a
        placeholder: remember their waiting request, to patch it when that step lands."""
        inflight = self.inflight
        if inflight is None or inflight.values is not None:
            return
        in_flight = {inflight.requests[i].uid for i in inflight.sampled}
        for uid in uids:
            pending = cache_scheduler.waiting_request(uid) if uid in in_flight else None
            if pending is not None:
                self._resumed[uid] = pending

    def patch_tokens(self, step: LaunchedStep) -> None:
        """The step's tokens arrived: write them where its bookkeeping left placeholders."""
        reqs, resumed_by_uid = step.requests, self._resumed
        for i, at, t in zip(step.sampled, step.patch_at, step.tokens()):
            reqs[i].set_host_token(at, t)
            if resumed_by_uid:
                resumed = resumed_by_uid.pop(reqs[i].uid, None)
                if resumed is not None:  # preempted by the next step: it waits with this token last
                    resumed.input_ids[at] = t

    def stopped_late(self, uid: int) -> None:
        self._late_stops.add(uid)
        self.late_stop_count += 1

    def take_late_stops(self, step: LaunchedStep) -> List[int]:
        """The late stops among the step's sampled rows, in batch order: its bookkeeping releases them."""
        late_stops = self._late_stops
        if not late_stops:
            return []
        reqs = step.requests
        late = [reqs[i].uid for i in step.sampled if reqs[i].uid in late_stops]
        late_stops.difference_update(late)
        return late

    def pop_late_stops(self) -> List[int]:
        """The late stops no step's bookkeeping released (not in its batch): each gets an operation."""
        uids, self._late_stops = sorted(self._late_stops), set()
        return uids

    def forget(self, uid: int) -> None:
        self._resumed.pop(uid, None)
