"""Comparing two cache-side states operation by operation: the invariants on each side, then the
whole observable state side by side. The first difference raises a `Finding` naming the step, the
operation and what differed. `--verify` (the shadow verifier) and the lockstep harness both use it."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from kvledger.engine.ledger.cache_scheduler import CacheScheduler, InvariantViolation
from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.observer import LedgerState

__all__ = ["Finding", "compare", "state_diff"]


def _owner_diff(ref: List[Any], fst: List[Any], limit: int = 8) -> str:
    ref_d, fst_d = dict(ref), dict(fst)
    pages = [p for p in sorted(set(ref_d) | set(fst_d)) if ref_d.get(p) != fst_d.get(p)]
    shown = ", ".join(f"loc {p}: reference {ref_d.get(p)} vs fast {fst_d.get(p)}" for p in pages[:limit])
    return f"{len(pages)} pages differ: {shown}"


def state_diff(ref: Dict[str, Any], fst: Dict[str, Any]) -> Tuple[str, str] | None:
    """The first field of two snapshots that differs, as (name, what differed); None if none."""
    for key in ref:
        if ref[key] != fst[key]:
            if key == "owners":
                return "owner", _owner_diff(ref[key], fst[key])
            return key, f"reference {ref[key]} vs fast {fst[key]}"
    return None


def compare(ref: CacheScheduler, fst: LedgerState, step: int, op: Dict[str, Any]) -> None:
    """Invariants on each side, then the whole observable state side by side (`fst`: a scheduler,
    or the state the engine's shadow verifier is shown)."""
    sides: Tuple[Tuple[str, LedgerState], ...] = (("reference", ref), ("fast", fst))
    for name, ledger in sides:
        try:
            ledger.check()
        except InvariantViolation as e:
            prefix = "reference-invariant" if name == "reference" else "invariant"
            raise Finding(f"{prefix}:{e.invariant}", str(e), step=step, op=op) from e
    diff = state_diff(ref.snapshot(), fst.snapshot())
    if diff is not None:
        raise Finding(f"state:{diff[0]}", diff[1], step=step, op=op)
