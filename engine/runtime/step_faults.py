"""Injected faults inside a step, and their containment.

The engine holds a `StepFaults` only while a fault plan is set (`faults.py`); without one it pays
nothing. Each batch the engine is about to run is a step, numbered from 1 (a step that failed
counts).

forward-raise raises inside the model's forward pass (`forward`), where a real error would, and the
engine contains it as it contains a real one (`step_errors.py`): the step completes as failed and
every request of its batch ends with the error. Rehearsing it rehearses that path itself.

alloc-refuse strikes while the batch is being scheduled, so it is undone rather than completed:
before a step in which it may fire, the cache scheduler and the engine's own request state are
checkpointed (`ledger/rollback.py`); when it strikes, everything goes back to that checkpoint and
the refused request is aborted by an ordinary operation, which the observers (`--verify`'s
reference model, a trace) hear of like any abort. Its pages return to the pool; every other
request runs on as if the step had never been tried.

One thing the observers heard of before the batch was chosen is put back after the rollback: an
admission attempt that admitted nothing (`Scheduler.schedule` records it as an operation of its
own) is applied again, so the engine's ledger and theirs stay equal.

Uncontained faults raise out of the step: cuda-poison (`UncontainableFault`: the device context
cannot be trusted) and step-stall (it blocks; the server's watchdog declares the engine stalled).
rank-kill and rank-stop belong to the tensor-parallel ranks (`engine/distributed`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from kvledger.engine.ledger.ops import Prefill
from kvledger.engine.ledger.rollback import Checkpoint
from kvledger.engine.runtime.faults import (
    ALLOC_REFUSE,
    CUDA_POISON,
    FORWARD_RAISE,
    STEP_STALL,
    FaultPlan,
    InjectedFault,
    UncontainableFault,
)
from kvledger.engine.runtime.requests import TokenEvent
from kvledger.engine.runtime.scheduler import Batch

if TYPE_CHECKING:
    from kvledger.engine.runtime.overlap import LaunchedStep

log = logging.getLogger("kvledger.faults")

ROLLED_BACK = frozenset({ALLOC_REFUSE})  # the kinds that strike mid-schedule: the step is undone


class StepFaults:
    def __init__(self, engine: Any, plan: FaultPlan, abort: Callable[[int], None]) -> None:
        """`engine`: the Engine; `abort`: its own abort (on a tensor-parallel rank 0, not the one that
        also tells the other ranks: every rank strikes and ends the same requests by itself)."""
        self.engine = engine
        self.plan = plan
        self.abort = abort
        self.step = 0  # the last step tried
        self.struck: Dict[str, int] = {}  # faults that struck, by kind
        self._ended: List[TokenEvent] = []  # the error events of requests a contained fault ended

    def launch(
        self, schedule: Callable[[], Optional[Batch]], run: Callable[[Batch], LaunchedStep]
    ) -> Optional[LaunchedStep]:
        """The engine's launch (`schedule` then `run` the model), with this step's faults."""
        engine = self.engine
        cache = engine.cache_scheduler
        checkpoint = self._checkpoint() if self.plan.may_fire(ROLLED_BACK, self.step + 1) else None
        queued = cache.queue_length()
        batch = schedule()
        if batch is None:
            return None
        self.step += 1
        try:
            self._strike(batch)
        except UncontainableFault:
            raise
        except InjectedFault as e:
            if checkpoint is None:  # cannot happen: a contained kind is due only where may_fire said so
                raise
            self._roll_back(checkpoint, batch, attempted_admission=queued > 0 and batch.phase == "decode")
            self._end(list(e.touched), str(e))
            return None
        return run(batch)

    def forward(self, batch: Batch) -> None:
        """Called where the model's forward pass starts: an injected forward-raise raises here."""
        uids = [r.uid for r in batch.requests]
        if (hit := self.plan.due_in_batch(FORWARD_RAISE, self.step, uids)) is not None:
            self._count(FORWARD_RAISE)
            why = f"the model's forward pass raised at step {self.step} (injected forward-raise)"
            raise InjectedFault(hit[0], why, uids)

    def take_ended(self) -> List[TokenEvent]:
        events, self._ended = self._ended, []
        return events

    # -- the faults ---------------------------------------------------------------------------
    def _strike(self, batch: Batch) -> None:
        plan, step = self.plan, self.step
        uids = [r.uid for r in batch.requests]
        if (hit := plan.due_in_batch(STEP_STALL, step, uids)) is not None:
            fault = hit[0]
            self._count(STEP_STALL)
            log.warning("injected step-stall at step %d: blocking %s", step, _for(fault.seconds))
            if fault.seconds is None:
                threading.Event().wait()  # never set: only the watchdog ends this
            else:
                time.sleep(fault.seconds)
        if (hit := plan.due_in_batch(CUDA_POISON, step, uids)) is not None:
            self._count(CUDA_POISON)
            raise UncontainableFault(
                hit[0],
                f"CUDA error: an illegal memory access was encountered (injected cuda-poison at step {step}); "
                "the device context cannot be trusted",
            )
        if (hit := plan.due_in_batch(ALLOC_REFUSE, step, uids)) is not None:
            self._count(ALLOC_REFUSE)
            fault, uid = hit
            why = f"the KV pool refused the pages request {uid} needs at step {step} (injected alloc-refuse)"
            raise InjectedFault(fault, why, [uid])

    def _count(self, kind: str) -> None:
        self.struck[kind] = self.struck.get(kind, 0) + 1

    # -- containment ----------------------------------------------------------------------------
    def _checkpoint(self) -> Checkpoint:
        e = self.engine
        cache = e.cache_scheduler
        # the cache scheduler leaves out what its own rollback leaves out (CacheScheduler._checkpoint)
        keep = (cache.impl, cache.after_forward, cache.page_table, cache.tm.token_pool, cache.provenance)
        return Checkpoint((cache, e.requests, e.prefix_sharing), keep=keep)

    def _roll_back(self, checkpoint: Checkpoint, batch: Batch, attempted_admission: bool) -> None:
        e = self.engine
        checkpoint.restore()
        if attempted_admission:  # the observers heard of it: the ledger does it again, alike
            e.cache_scheduler.apply(Prefill(e.config.max_prefill_tokens))
        for uid in batch.preempted:  # not preempted after all: nothing of theirs waits on a placeholder
            e.overlap.forget(uid)

    def _end(self, uids: List[int], message: str) -> None:
        e = self.engine
        log.error("%s: ending request(s) %s; the step was rolled back", message, uids)
        for uid in uids:
            rec = e.requests.get(uid)
            cached = (rec.cached_tokens or 0) if rec is not None else 0
            self.abort(uid)
            self._ended.append(TokenEvent(uid, 0, True, "error", message, cached))


def _for(seconds: Optional[float]) -> str:
    return "forever" if seconds is None else f"{seconds} s"


def describe_batch(batch: Optional[Batch]) -> str:
    """One line per request of a batch: uid, phase, computed and device lengths (for the watchdog's dump)."""
    if batch is None:
        return "no batch"
    rows: List[str] = [f"{batch.phase} batch of {len(batch.requests)}:"]
    for r in batch.requests:
        rows.append(f"  uid {r.uid}: cached_len {_int(r, 'cached_len')}, device_len {_int(r, 'device_len')}")
    return "\n".join(rows)


def _int(req: Any, name: str) -> Any:
    return getattr(req, name, "?")
