"""Comparing two cache-side states operation by operation: the invariants on each side, then the
whole observable state side by side. The first difference raises `Divergence` naming the step, the
operation and what differed. `--verify` (the shadow verifier) and the lockstep harness both use it."""

from __future__ import annotations

from typing import Dict, List

from kvledger.engine.ledger.cache_scheduler import CacheScheduler, InvariantViolation


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


def compare(ref: CacheScheduler, fst: CacheScheduler, step: int, op: Dict) -> None:
    """Invariants on each side, then the whole observable state side by side."""
    for name, ledger in (("reference", ref), ("fast", fst)):
        try:
            ledger.check()
        except InvariantViolation as e:
            prefix = "reference-invariant" if name == "reference" else "invariant"
            raise Divergence(step, op, f"{prefix}:{e.invariant}", str(e)) from e
    diff = _state_diff(ref.snapshot(), fst.snapshot())
    if diff is not None:
        raise Divergence(step, op, f"state:{diff[0]}", diff[1])
