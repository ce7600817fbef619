"""What watches the engine's cache operations, and the state it is shown.

The engine tells every observer of each operation it performed on `fast`, in order, as an
`OpRecord` (the typed operation and what the engine saw it do). Observers are the trace recorder
(`recorder.py`), the shadow verifier (`shadow.py`) and, under tensor parallelism, the cross-rank
check (`engine/distributed/rank_agreement.py`). With overlap an operation's sampled tokens are known only
a step later: an observer that compares state (`needs_state`) is then shown the state frozen
right after the operation, not the live one.
"""

from __future__ import annotations

from typing import Any, Dict, Protocol, Union

from kvledger.engine.ledger.cache_scheduler import CacheScheduler, InvariantViolation
from kvledger.engine.ledger.ops import OpRecord


class FrozenState:
    """A cache scheduler's invariant check and full snapshot, taken right after an operation."""

    def __init__(self, ledger: CacheScheduler) -> None:
        self.error: InvariantViolation | None = None
        try:
            ledger.check()
        except InvariantViolation as e:
            self.error = e
        self._snapshot = ledger.snapshot()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def snapshot(self) -> Dict[str, Any]:
        return self._snapshot


# what an observer may read of the state: `check()` and `snapshot()`
LedgerState = Union[CacheScheduler, FrozenState]


class Observer(Protocol):
    needs_state: bool  # whether it reads the state (and must then see it frozen under overlap)

    def __call__(self, step: int, record: OpRecord, state: LedgerState) -> None: ...
