"""The engine's cache operations on their way to its observers, in order.

Every operation the engine performs on its cache scheduler is queued here as an `OpRecord`. An
operation whose sampled tokens are still on the GPU (overlap) waits, and so does everything after
it: observers hear of operations in the order they ran, each once its tokens are known. An
observer that compares state is then shown the state frozen right after the operation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Deque, List, Optional, Sequence

from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.engine.ledger.observer import FrozenState, Observer
from kvledger.engine.ledger.ops import Decode, Expect, OpRecord, Prefill


@dataclass
class PendingOp:
    record: OpRecord
    ready: bool
    state: Optional[FrozenState]  # the state right after it, for observers that compare state

    def fill_sample(self, sample: Sequence[int]) -> None:
        """The step's tokens are known: its operation gets them, and its observers may hear of it."""
        op = self.record.op
        assert isinstance(op, (Prefill, Decode))
        self.record = replace(self.record, op=replace(op, sample=tuple(sample)))
        self.ready = True


class OpStream:
    def __init__(self, cache_scheduler: CacheScheduler) -> None:
        self.cache_scheduler = cache_scheduler
        self.observers: List[Observer] = []
        self.delivered = 0  # operations every observer has been told of (the server's cache_ops)
        self._queue: Deque[PendingOp] = deque()

    def record(self, record: OpRecord, ready: bool = True) -> PendingOp:
        """Queue an operation the cache scheduler just performed; observers hear of it once it is ready."""
        # an operation that waits (for its tokens, or behind one that does) is shown the state
        # of its own moment; one told at once is shown the live state, which is the same
        waits = not ready or bool(self._queue)
        frozen = FrozenState(self.cache_scheduler) if waits and any(o.needs_state for o in self.observers) else None
        entry = PendingOp(record, ready, frozen)
        self._queue.append(entry)
        self.flush()
        return entry

    def flush(self) -> None:
        while self._queue and self._queue[0].ready:
            pending = self._queue.popleft()
            self.delivered += 1
            state = pending.state if pending.state is not None else self.cache_scheduler
            for observer in self.observers:
                observer(self.delivered, pending.record, state)


def step_record(
    phase: str,
    budget: int,
    sample: Sequence[int],
    stop: Sequence[int],
    batch: Sequence[int],
    preempted: Sequence[int],
    preempts: bool,
) -> OpRecord:
    """A prefill (with its token budget) or decode step as the engine ran it: what was sampled and
    stopped, and what it saw (the batch, and the uids preempted under a preempting policy)."""
    op = Prefill(budget, tuple(sample), tuple(stop)) if phase == "prefill" else Decode(tuple(sample), tuple(stop))
    return OpRecord(op, Expect.of_batch(batch, preempted if preempts else None))
