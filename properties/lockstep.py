"""Run reference and fast side by side on one operation stream and compare everything.

After each operation: the operation's result (batch, admission decision, evicted pages, match),
then the full observable state (page -> owner, free-list order, live rows, lengths,
available_size, cache sizes, table slots, queues), then the invariants on each side (`engine/ledger/invariants.py`)
(`kvledger.engine.ledger.divergence.compare`). The first difference raises `Divergence` with the step,
the operation and what differed.
"""

from __future__ import annotations

from typing import Any, Dict, List

from kvledger import fast, reference
from kvledger.engine.ledger.cache_scheduler import CacheScheduler, InvalidOp, InvariantViolation
from kvledger.engine.ledger.divergence import Divergence, compare
from kvledger.engine.ledger.trace import Header


class Lockstep:
    def __init__(self, header: Header, device: str = "cpu", fast_impl: Any = fast) -> None:
        self.header = header
        self.ref = CacheScheduler(reference, **header.cache_scheduler_args())
        self.fast = CacheScheduler(fast_impl, device=device, **header.cache_scheduler_args())
        self.ops: List[Dict] = []
        self.step = 0

    def apply(self, op: Dict) -> Dict:
        self.step += 1
        # Recorded before either side runs it: whichever side fails (the reference too, on an
        # invariant only the model checks), the saved trace ends with the failing operation.
        # Only an operation the model refuses as invalid is dropped: it was never a valid step.
        self.ops.append(op)
        try:
            result = self.ref.apply(op)
        except InvalidOp:
            self.ops.pop()
            raise
        except InvariantViolation as e:
            raise Divergence(self.step, op, f"reference-invariant:{e.invariant}", str(e)) from e
        except Exception as e:  # the model itself crashed: as much a failure to keep as fast's
            raise Divergence(self.step, op, f"reference-raised:{type(e).__name__}", str(e)) from e
        try:
            fast_result = self.fast.apply(op)
        except InvariantViolation as e:
            raise Divergence(self.step, op, f"invariant:{e.invariant}", str(e)) from e
        except Exception as e:  # anything fast raises where the model did not
            raise Divergence(self.step, op, f"fast-raised:{type(e).__name__}", str(e)) from e
        if result != fast_result:
            raise Divergence(self.step, op, f"result:{op['op']}", f"reference {result} vs fast {fast_result}")
        expect = op.get("expect")
        if expect is not None and {k: result.get(k) for k in expect} != expect:
            raise Divergence(self.step, op, f"expect:{op['op']}", f"recorded {expect}, replayed {result}")
        compare(self.ref, self.fast, self.step, op)
        return result


def replay(header: Header, ops: List[Dict], device: str = "cpu") -> Lockstep:
    """Replay a trace; raises Divergence or InvalidOp (with `.step` set) at the first problem."""
    lock = Lockstep(header, device)
    for op in ops:
        try:
            lock.apply(op)
        except InvalidOp as e:
            e.step = lock.step  # type: ignore[attr-defined]
            raise
    return lock
