"""Run reference and fast side by side on one operation stream and compare everything.

After each operation: the operation's result (batch, admission decision, evicted pages, match),
then the full observable state (page -> owner, free-list order, live rows, lengths,
available_size, cache sizes, table slots, queues), then the invariants on each side
(`engine/ledger/invariants.py`, through `kvledger.engine.ledger.divergence.compare`). The first
difference raises a `Finding` with the step, the operation and what differed. A header that sets
`spec_tokens` makes both sides speculate (`speculating_scheduler.py`: each decode verifies drafts).

A line is applied as an `OpRecord` (the operation and its optional `expect`); `apply` also takes a
bare `CacheOp`, and a dict trace line is parsed once at the entry while callers still build dicts.
"""

from __future__ import annotations

import copy
from types import ModuleType
from typing import Any, Dict, List, Sequence

from kvledger import fast, reference
from kvledger.engine.ledger.cache_scheduler import CacheScheduler, InvalidOp, InvariantViolation
from kvledger.engine.ledger.divergence import compare
from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import OpRecord, OpResult, TraceLine, as_record
from kvledger.engine.ledger.trace import Header
from kvledger.properties import write_ahead

__all__ = ["Finding", "InvalidOp", "Lockstep", "replay"]


class Lockstep:
    def __init__(self, header: Header, device: str = "cpu", fast_impl: ModuleType = fast) -> None:
        self.header = header
        self.ref = _scheduler(header, reference)
        self.fast = _scheduler(header, fast_impl, device=device)
        self.ops: List[OpRecord] = []
        self.step = 0

    def apply(self, line: TraceLine) -> OpResult:
        """Apply one trace line to both sides; the first difference raises a Finding."""
        record = as_record(line)
        op = record.to_json()  # as a Finding shows the failing line
        self.step += 1
        # Recorded before either side runs it: whichever side fails (the reference too, on an
        # invariant only the model checks), the saved trace ends with the failing operation.
        # Only an operation the model refuses as invalid is dropped: it was never a valid step.
        write_ahead.before(self, lambda: self.header, self.ops, record)
        self.ops.append(record)
        try:
            result = self.ref.apply(record.op)
        except InvalidOp:
            self.ops.pop()
            write_ahead.undo(self)
            raise
        except InvariantViolation as e:
            raise self._finding(op, f"reference-invariant:{e.invariant}", str(e)) from e
        except Exception as e:  # the model itself crashed: as much a failure to keep as fast's
            raise self._finding(op, f"reference-raised:{type(e).__name__}", str(e)) from e
        try:
            fast_result = self.fast.apply(record.op)
        except InvariantViolation as e:
            raise self._finding(op, f"invariant:{e.invariant}", str(e)) from e
        except Exception as e:  # anything fast raises where the model did not
            raise self._finding(op, f"fast-raised:{type(e).__name__}", str(e)) from e
        if result != fast_result:
            raise self._finding(op, f"result:{op['op']}", f"reference {_shown(result)} vs fast {_shown(fast_result)}")
        expect = record.expect
        if expect is not None and not expect.matches(result):
            raise self._finding(op, f"expect:{op['op']}", f"recorded {expect.as_dict()}, replayed {_shown(result)}")
        compare(self.ref, self.fast, self.step, op)
        return result

    def copy(self) -> Lockstep:
        """An independent copy of both sides: everything but the implementation modules, the
        header and the operations so far (never mutated: a shallow copy of the list will do)."""
        memo = {id(fast): fast, id(reference): reference, id(self.header): self.header, id(self.ops): list(self.ops)}
        for impl in (self.ref.impl, self.fast.impl):
            memo[id(impl)] = impl
        return copy.deepcopy(self, memo)

    def _finding(self, op: Dict[str, Any], kind: str, message: str) -> Finding:
        return Finding(kind, message, step=self.step, op=op)


def _scheduler(header: Header, impl: ModuleType, **kwargs: Any) -> CacheScheduler:
    """One side: a speculating cache scheduler when the header sets `spec_tokens` (its module is
    loaded only then: Hypothesis draws from the literals of every loaded module)."""
    if not header.spec_tokens:
        return CacheScheduler(impl, **kwargs, **header.cache_scheduler_args())
    from kvledger.properties.speculating_scheduler import SpeculatingCacheScheduler

    return SpeculatingCacheScheduler(impl, spec_tokens=header.spec_tokens, **kwargs, **header.cache_scheduler_args())


def _shown(result: OpResult) -> Dict[str, Any]:
    """A result as a message shows it: the fields the operation produced, as a trace writes them."""
    return {k: v for k, v in result.seen(_FIELDS).items() if v is not None}


_FIELDS = tuple(OpResult.__dataclass_fields__)


def replay(header: Header, ops: Sequence[TraceLine], device: str = "cpu") -> Lockstep:
    """Replay a trace; raises a Finding or InvalidOp (with `.step` set) at the first problem."""
    lock = Lockstep(header, device)
    for op in ops:
        try:
            lock.apply(op)
        except InvalidOp as e:
            e.step = lock.step  # type: ignore[attr-defined]
            raise
    return lock
