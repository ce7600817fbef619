"""Fault injection: make the engine fail on purpose, at a chosen step or request, deterministic by seed.

Off by default. Set it with the engine option `--inject-fault SPEC` (generate, serve) or the
environment variable `KVLEDGER_INJECT_FAULT=SPEC`; the option wins when both are given. When off
the engine holds `None` and pays one `is None` check per step.

    SPEC   := FAULT [';' FAULT]...
    FAULT  := KIND '@' 'step=' N [',' KEY '=' VALUE]...
    KEY    := request | seed | times | seconds | rank

    KIND          what happens                                           contained?
    forward-raise the model's forward pass raises                        yes: the step's requests end
    alloc-refuse  the pool refuses the pages one request of the step needs  yes: that request ends
    step-stall    the step blocks `seconds=T` (forever without it)       no: the watchdog declares it
    cuda-poison   an error that poisons the device context               no: the engine is dead
    rank-kill     (tensor parallel) rank `rank=R` is killed (SIGKILL)     no
    rank-stop     (tensor parallel) rank `rank=R` is stopped (SIGSTOP)    no

`step=N` counts the engine's steps that run a batch, from 1. A fault fires at the first step at or
after N that it applies to (with `request=UID`: a step whose batch holds that request), and again at
the next ones until it has fired `times=K` times (default 1). Where a fault picks one request of a
batch (alloc-refuse without `request=`) it draws it with `seed=S` (default 0) and the step number,
so the same spec on the same workload fails the same request.

    forward-raise@step=5
    alloc-refuse@step=3,seed=7;step-stall@step=20,seconds=2
    rank-kill@step=4,rank=1
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["ENV_VAR", "KINDS", "Fault", "FaultPlan", "InjectedFault", "UncontainableFault"]

ENV_VAR = "KVLEDGER_INJECT_FAULT"
FORWARD_RAISE = "forward-raise"
ALLOC_REFUSE = "alloc-refuse"
STEP_STALL = "step-stall"
CUDA_POISON = "cuda-poison"
RANK_KILL = "rank-kill"
RANK_STOP = "rank-stop"
KINDS: Tuple[str, ...] = (FORWARD_RAISE, ALLOC_REFUSE, STEP_STALL, CUDA_POISON, RANK_KILL, RANK_STOP)
RANK_KINDS = frozenset({RANK_KILL, RANK_STOP})
CONTAINED_KINDS = frozenset({FORWARD_RAISE, ALLOC_REFUSE})  # the requests they touch end, the others go on
_KEYS = ("step", "request", "seed", "times", "seconds", "rank")


@dataclass(frozen=True)
class Fault:
    """One planned fault. `seconds` is step-stall's stall (None: forever); `rank` the rank a
    rank-kill/rank-stop hits; `request` the uid it waits for (None: any step)."""

    kind: str
    step: int
    request: Optional[int] = None
    rank: Optional[int] = None
    seconds: Optional[float] = None
    times: int = 1
    seed: int = 0

    def __str__(self) -> str:
        parts = [f"{self.kind}@step={self.step}"]
        for key in ("request", "rank", "seconds"):
            value = getattr(self, key)
            if value is not None:
                parts.append(f"{key}={value}")
        if self.times != 1:
            parts.append(f"times={self.times}")
        if self.seed:
            parts.append(f"seed={self.seed}")
        return ",".join(parts)

    def pick(self, step: int, uids: Sequence[int]) -> Optional[int]:
        """The request of a batch (`uids`) this fault hits at `step`: its own request when it names
        one (None if that one is not in the batch), else one drawn by seed and step."""
        if self.request is not None:
            return self.request if self.request in uids else None
        if not uids:
            return None
        return random.Random(self.seed * 1_000_003 + step).choice(sorted(uids))


class InjectedFault(RuntimeError):
    """Raised where an injected fault strikes, carrying it. The engine contains it when the kind is
    containable; `UncontainableFault` marks the ones that end the engine."""

    def __init__(self, fault: Fault, message: str, touched: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.fault = fault
        self.touched: Tuple[int, ...] = tuple(touched)  # the requests it ends, when contained


class UncontainableFault(InjectedFault):
    """An injected fault after which the engine's state cannot be trusted (cuda-poison)."""


class FaultPlan:
    """The parsed spec plus how often each fault has fired. `due` both answers and counts."""

    def __init__(self, faults: Sequence[Fault]) -> None:
        self.faults: Tuple[Fault, ...] = tuple(faults)
        self._fired: List[int] = [0] * len(self.faults)

    def __repr__(self) -> str:
        return f"FaultPlan({';'.join(map(str, self.faults))!r})"

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(f.kind for f in self.faults)

    def wants(self, kind: str) -> bool:
        """Whether a fault of `kind` may still fire."""
        return any(f.kind == kind and n < f.times for f, n in zip(self.faults, self._fired))

    def may_fire(self, kinds: frozenset[str], step: int) -> bool:
        """Whether a fault of one of `kinds` may fire at `step` (due for it, not fired out)."""
        return any(f.kind in kinds and step >= f.step and n < f.times for f, n in zip(self.faults, self._fired))

    def due(self, kind: str, step: int, request: Optional[int] = None) -> Optional[Fault]:
        """The fault of `kind` that fires at `step` (and for `request`, when the fault names one; a
        fault that names a request never fires for `request=None`), counted as fired; else None."""
        for i, f in enumerate(self.faults):
            if f.kind != kind or step < f.step or self._fired[i] >= f.times:
                continue
            if f.request is not None and f.request != request:
                continue
            self._fired[i] += 1
            return f
        return None

    def due_in_batch(self, kind: str, step: int, uids: Sequence[int]) -> Optional[Tuple[Fault, int]]:
        """The fault of `kind` that fires at `step` on a batch of `uids`, with the uid it hits
        (`Fault.pick`); counted as fired. None when none applies to this batch."""
        for i, f in enumerate(self.faults):
            if f.kind != kind or step < f.step or self._fired[i] >= f.times:
                continue
            uid = f.pick(step, uids)
            if uid is None:
                continue
            self._fired[i] += 1
            return f, uid
        return None

    def fired(self) -> Dict[str, int]:
        """Firings so far, by kind."""
        out: Dict[str, int] = {}
        for f, n in zip(self.faults, self._fired):
            out[f.kind] = out.get(f.kind, 0) + n
        return out

    # -- parsing ------------------------------------------------------------------------------
    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        """Parse SPEC (the module's grammar). Raises ValueError naming what was wrong."""
        if not spec or not spec.strip():
            raise ValueError("fault spec is empty: expected KIND@step=N[,key=value]... (see engine/runtime/faults.py)")
        faults = [_parse_fault(part.strip()) for part in spec.split(";") if part.strip()]
        if not faults:
            raise ValueError(f"fault spec {spec!r} names no fault")
        return cls(faults)

    @classmethod
    def from_env(cls, environ: Optional[Dict[str, str]] = None) -> Optional[FaultPlan]:
        """The plan in KVLEDGER_INJECT_FAULT, or None when it is unset or empty."""
        spec = (os.environ if environ is None else environ).get(ENV_VAR, "")
        return cls.parse(spec) if spec.strip() else None

    @classmethod
    def resolve(cls, option: Optional[str], environ: Optional[Dict[str, str]] = None) -> Optional[FaultPlan]:
        """The plan of the `--inject-fault` option, else of the environment, else None."""
        if option is not None and option.strip():
            return cls.parse(option)
        return cls.from_env(environ)


def _parse_fault(text: str) -> Fault:
    kind, at, rest = text.partition("@")
    kind = kind.strip()
    if kind not in KINDS:
        raise ValueError(f"fault {text!r}: unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
    if not at or not rest.strip():
        raise ValueError(f"fault {text!r}: expected {kind}@step=N[,key=value]...")
    values: Dict[str, str] = {}
    for item in rest.split(","):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or not key or not value:
            raise ValueError(f"fault {text!r}: {item.strip()!r} is not key=value")
        if key not in _KEYS:
            raise ValueError(f"fault {text!r}: unknown key {key!r}; keys: {', '.join(_KEYS)}")
        if key in values:
            raise ValueError(f"fault {text!r}: {key!r} given twice")
        values[key] = value
    if "step" not in values:
        raise ValueError(f"fault {text!r}: step=N is required")
    fault = Fault(
        kind=kind,
        step=_int(text, values, "step", 1),
        request=_int(text, values, "request", 0) if "request" in values else None,
        rank=_int(text, values, "rank", 0) if "rank" in values else None,
        seconds=_seconds(text, values["seconds"]) if "seconds" in values else None,
        times=_int(text, values, "times", 1) if "times" in values else 1,
        seed=_int(text, values, "seed", 0) if "seed" in values else 0,
    )
    if fault.seconds is not None and kind != STEP_STALL:
        raise ValueError(f"fault {text!r}: seconds= applies to step-stall only")
    if fault.rank is not None and kind not in RANK_KINDS:
        raise ValueError(f"fault {text!r}: rank= applies to rank-kill and rank-stop only")
    if kind in RANK_KINDS and fault.rank is None:
        raise ValueError(f"fault {text!r}: {kind} needs rank=R")
    return fault


def _int(text: str, values: Dict[str, str], key: str, least: int) -> int:
    try:
        n = int(values[key])
    except ValueError:
        raise ValueError(f"fault {text!r}: {key}={values[key]!r} is not an integer") from None
    if n < least:
        raise ValueError(f"fault {text!r}: {key}={n} must be >= {least}")
    return n


def _seconds(text: str, value: str) -> float:
    try:
        t = float(value)
    except ValueError:
        raise ValueError(f"fault {text!r}: seconds={value!r} is not a number") from None
    if not t > 0 or t != t or t == float("inf"):
        raise ValueError(f"fault {text!r}: seconds={value} must be a positive finite number")
    return t
