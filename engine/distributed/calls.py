"""What rank 0's scheduler tells the other ranks: the calls it took, in order, once per step.

Every rank runs the same scheduler over the same calls; the scheduler is deterministic (no
wall-clock, seeded sampling, logits identical on every rank after the LM head's gather), so every
rank makes the same cache operations and its page table agrees with rank 0's. `--verify` checks
that after every operation (engine/distributed/rank_agreement.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple, Union

from kvledger.fast import SamplingParams


@dataclass(frozen=True)
class SubmitCall:
    uid: int
    token_ids: Tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class AbortCall:
    uid: int


@dataclass(frozen=True)
class StepCall:
    pass


@dataclass(frozen=True)
class ShutdownCall:
    pass


EngineCall = Union[SubmitCall, AbortCall, StepCall, ShutdownCall]
