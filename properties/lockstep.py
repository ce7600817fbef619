"""Run reference and fast side by side on one operation stream and compare everything.

After each operation: the operation's result (batch, admission decision, evicted pages, match),
then the full observable state (page -> owner, free-list order, live rows, lengths,
available_size, cache sizes, table slots, queues), then the five invariants on each side.
The first difference raises `Divergence` with the step, the operation and what differed.
"""

from __future__ import annotations

from typing import Any, Dict, List

import fast
import reference

from .driver import Driver, InvalidOp, InvariantViolation
from .trace import Header


class Divergence(AssertionError):
    def __init__(self, step: int, op: Dict, kind: str, detail: str) -> None:
        super().__init__(f"step {step}, op {op}: {kind}: {detail}")
        self.step, self.op, self.kind, self.detail = step, op, kind, detail

    @property
    def fingerprint(self) -> str:
        return self.kind


def _owner_diff(ref: List, fst: List, limit: int = 8) -> str:
    ref_d, fst_d = dict(ref), dict(fst)
    pages = [p for p in sorted(set(ref_d) | set(fst_d)) if ref_d.get(p) != fst_d.get(p)]
    shown = ", ".join(f"loc {p}: reference {ref_d.get(p)} vs fast {fst_d.get(p)}" for p in pages[:limit])
    return f"{len(pages)} pages differ: {shown}"


def _state_diff(ref: Dict, fst: Dict) -> tuple[str, str] | None:
    for key in ref:
        if ref[key] != fst[key]:
            if key == "owners":
                return "owner", _owner_diff(ref[key], fst[key])
            return key, f"reference {ref[key]} vs fast {fst[key]}"
    return None


def compare(ref: Driver, fst: Driver, step: int, op: Dict) -> None:
    """Invariants on each side, then the whole observable state side by side."""
    for name, driver in (("reference", ref), ("fast", fst)):
        try:
            driver.check()
        except InvariantViolation as e:
            prefix = "reference-invariant" if name == "reference" else "invariant"
            raise Divergence(step, op, f"{prefix}:{e.invariant}", str(e)) from e
    diff = _state_diff(ref.snapshot(), fst.snapshot())
    if diff is not None:
        raise Divergence(step, op, f"state:{diff[0]}", diff[1])


class Lockstep:
    def __init__(self, header: Header, device: str = "cpu", fast_impl: Any = fast) -> None:
        self.header = header
        self.ref = Driver(reference, **header.driver_args())
        self.fast = Driver(fast_impl, device=device, **header.driver_args())
        self.ops: List[Dict] = []
        self.step = 0

    def apply(self, op: Dict) -> Dict:
        self.step += 1
        try:
            result = self.ref.apply(op)
        except InvalidOp:
            raise
        except InvariantViolation as e:
            raise Divergence(self.step, op, f"reference-invariant:{e.invariant}", str(e)) from e
        self.ops.append(op)
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
