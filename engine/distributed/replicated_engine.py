"""Rank 0's engine under tensor parallelism, and the loop the other ranks run.

Rank 0 takes submits and aborts as usual (validating them first, so a bad request is refused
before any rank hears of it) and queues each call it accepted; each `step` sends the queue to the
other ranks, which replay it on their own engine, and then every rank steps. The engines
then agree call for call: they admit, preempt and allocate alike, and the model's collectives
inside each step meet. The engine's decisions are thus made once per step by the same
deterministic code on every rank (as SGLang's tensor-parallel engines do), not shipped as
page numbers; `--verify` proves they agree (engine/distributed/rank_agreement.py).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Sequence

from kvledger import fast
from kvledger.engine.distributed.calls import AbortCall, EngineCall, ShutdownCall, StepCall, SubmitCall
from kvledger.engine.distributed.group import TensorParallelGroup
from kvledger.engine.distributed.rank_agreement import RankAgreement
from kvledger.engine.distributed.rank_faults import RankFaults
from kvledger.engine.runtime.engine import Engine, TokenEvent

log = logging.getLogger(__name__)

# called on every rank before each step as hook(rank, step_index, engine); for fault-injection tests
RankHook = Callable[[int, int, Engine], None]


class RankCoordination:
    """What every rank adds to its engine: the group, the optional agreement check, the hook, and
    the rank faults of the engine's fault spec (engine/distributed/rank_faults.py)."""

    def __init__(self, group: TensorParallelGroup, verify: bool, hook: Optional[RankHook] = None) -> None:
        self.group = group
        self.agreement = RankAgreement(group) if verify else None
        self.hook = hook
        self.steps = 0
        self.faults: Optional[RankFaults] = None
        # rank 0: the error to raise for one that broke a step (the failed peer's, see ranks.py)
        self.explain: Callable[[BaseException], BaseException] = lambda error: error

    def attach(self, engine: Engine) -> None:
        if self.agreement is not None:
            engine.observers.append(self.agreement)
        self.faults = RankFaults.for_engine(engine, self.group.rank, self.group.size)

    def step(self, engine: Engine, run: Callable[[], List[TokenEvent]]) -> List[TokenEvent]:
        if self.hook is not None:
            self.hook(self.group.rank, self.steps, engine)
        self.steps += 1
        if self.faults is not None:
            self.faults.before_step(self.steps)
        events = run()
        if self.agreement is not None:
            self.agreement.compare()
        return events


class ReplicatedEngine(Engine):
    """Rank 0's Engine: every accepted call is queued for the other ranks."""

    def __init__(self, *args: Any, coordination: RankCoordination, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.coordination = coordination
        coordination.attach(self)
        self._outbox: List[EngineCall] = []
        self.stopped: Optional[str] = None  # why the ranks stopped, once they have

    def add_request(self, token_ids: Sequence[int], params: fast.SamplingParams, uid: Optional[int] = None) -> int:
        self._check_running()
        uid = super().add_request(token_ids, params, uid)  # raises RequestError before anything is queued
        self._outbox.append(SubmitCall(uid, tuple(int(t) for t in token_ids), params))
        return uid

    def abort(self, uid: int) -> None:
        self._check_running()
        super().abort(uid)
        self._outbox.append(AbortCall(uid))

    @property
    def has_work(self) -> bool:
        # a rank lost while this engine is idle is work: the next step reports it (a server's engine
        # thread steps when there is work, and so learns of the loss within its idle poll)
        if self.stopped is None and self.coordination.group.failure is not None:
            return True
        return super().has_work

    def step(self) -> List[TokenEvent]:
        self._check_running()
        lost = self.coordination.group.failure
        if lost is not None:  # the watch saw a rank go: the others are killed already
            self.stopped = f"{type(lost).__name__}: {str(lost)[:200]}"
            raise lost
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
            group = self.coordination.group
            if group.failure is None:  # nobody left to tell otherwise
                group.leaving = True
                group.broadcast([ShutdownCall()])

    def _check_running(self) -> None:
        if self.stopped is not None:
            raise RuntimeError(f"the tensor-parallel engine has stopped ({self.stopped})")


def serve_rank(engine: Engine, coordination: RankCoordination) -> None:
    """A rank other than 0: replay rank 0's calls until it shuts down."""
    coordination.attach(engine)
    group = coordination.group
    while True:
        for call in group.broadcast(None):
            if isinstance(call, SubmitCall):
                engine.add_request(call.token_ids, call.params, call.uid)
            elif isinstance(call, AbortCall):
                engine.abort(call.uid)
            elif isinstance(call, StepCall):
                coordination.step(engine, engine.step)
            elif isinstance(call, ShutdownCall):
                log.info("rank %d: shut down after %d steps", group.rank, coordination.steps)
                return
            else:
                raise TypeError(f"rank {group.rank}: not an engine call: {call!r:.80}")
