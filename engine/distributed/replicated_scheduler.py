"""Rank 0's scheduler under tensor parallelism, and the loop the other ranks run.

Rank 0 takes submits and aborts as usual (validating them first, so a bad request is refused
before any rank hears of it) and queues each call it accepted; each `step` sends the queue to the
other ranks, which replay it on their own scheduler, and then every rank steps. The schedulers
then agree call for call: they admit, preempt and allocate alike, and the model's collectives
inside each step meet. The scheduler's decisions are thus made once per step by the same
deterministic code on every rank (as SGLang's tensor-parallel schedulers do), not shipped as
page numbers; `--verify` proves they agree (engine/distributed/ledger.py).
"""

from __future__ import annotations

import logging
from typing import Callable, List, Optional, Sequence

from kvledger import fast
from kvledger.engine.distributed.calls import AbortCall, EngineCall, ShutdownCall, StepCall, SubmitCall
from kvledger.engine.distributed.group import TensorParallelGroup
from kvledger.engine.distributed.ledger import LedgerCheck
from kvledger.engine.runtime.scheduler import Scheduler, TokenEvent

log = logging.getLogger(__name__)

# called on every rank before each step as hook(rank, step_index, scheduler); for fault-injection tests
RankHook = Callable[[int, int, Scheduler], None]


class RankCoordination:
    """What every rank adds to its scheduler: the group, the optional ledger check, the hook."""

    def __init__(self, group: TensorParallelGroup, verify: bool, hook: Optional[RankHook] = None) -> None:
        self.group = group
        self.ledger = LedgerCheck(group) if verify else None
        self.hook = hook
        self.steps = 0
        # rank 0: the error to raise for one that broke a step (the failed peer's, see ranks.py)
        self.explain: Callable[[BaseException], BaseException] = lambda error: error

    def attach(self, scheduler: Scheduler) -> None:
        if self.ledger is not None:
            scheduler.observers.append(self.ledger)

    def step(self, scheduler: Scheduler, run: Callable[[], List[TokenEvent]]) -> List[TokenEvent]:
        if self.hook is not None:
            self.hook(self.group.rank, self.steps, scheduler)
        self.steps += 1
        events = run()
        if self.ledger is not None:
            self.ledger.compare()
        return events


class ReplicatedScheduler(Scheduler):
    """Rank 0's Scheduler: every accepted call is queued for the other ranks."""

    def __init__(self, *args, coordination: RankCoordination, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.coordination = coordination
        coordination.attach(self)
        self._outbox: List[EngineCall] = []
        self.stopped: Optional[str] = None  # why the ranks stopped, once they have

    def submit(self, uid: int, token_ids: Sequence[int], params: fast.SamplingParams) -> None:
        self._check_running()
        super().submit(uid, token_ids, params)  # raises RequestError before anything is queued
        self._outbox.append(SubmitCall(uid, tuple(int(t) for t in token_ids), params))

    def abort(self, uid: int) -> None:
        self._check_running()
        super().abort(uid)
        self._outbox.append(AbortCall(uid))

    def step(self) -> List[TokenEvent]:
        self._check_running()
        calls, self._outbox = self._outbox + [StepCall()], []
        try:
            self.coordination.group.broadcast(calls)
            return self.coordination.step(self, super().step)
        except BaseException as error:
            # the ranks no longer agree on what ran: this engine is done
            self.stopped = f"{type(error).__name__}: {str(error)[:200]}"
            raised = self.coordination.explain(error)
            if raised is error:
                raise
            raise raised from error

    def shutdown(self) -> None:
        """Tell the other ranks to leave their loop (the queued calls are dropped)."""
        if self.stopped is None:
            self.stopped = "shut down"
            self.coordination.group.broadcast([ShutdownCall()])

    def _check_running(self) -> None:
        if self.stopped is not None:
            raise RuntimeError(f"the tensor-parallel engine has stopped ({self.stopped})")


def serve_rank(scheduler: Scheduler, coordination: RankCoordination) -> None:
    """A rank other than 0: replay rank 0's calls until it shuts down."""
    coordination.attach(scheduler)
    group = coordination.group
    while True:
        for call in group.broadcast(None):
            if isinstance(call, SubmitCall):
                scheduler.submit(call.uid, call.token_ids, call.params)
            elif isinstance(call, AbortCall):
                scheduler.abort(call.uid)
            elif isinstance(call, StepCall):
                coordination.step(scheduler, scheduler.step)
            elif isinstance(call, ShutdownCall):
                log.info("rank %d: shut down after %d steps", group.rank, coordination.steps)
                return
            else:
                raise TypeError(f"rank {group.rank}: not an engine call: {call!r:.80}")
