"""`SpeculatingLockstepMachine`: the lockstep machine with speculative decoding on both sides.

Every example draws how many drafts a decode verifies per request (1 to MAX_DRAFTS) into its
header's `spec_tokens`, so both sides run `SpeculatingCacheScheduler` (`speculating_scheduler.py`),
and its decode rule draws `accept` (how many of each request's drafts the model accepts, cycled over
the requests with drafts; empty: none): every draft rejected, some, every one. The other rules are
the lockstep machine's; a decode they issue (`grow`, `drain`) carries no `accept`, so it rejects
every draft. What a speculating run should reach on top of the lockstep events is `SPEC_EVENTS`.

This module (and the scheduler's) is loaded only when a run speculates: Hypothesis draws from the
literals of every loaded module, so the plain lockstep run draws what it always drew.
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Sequence

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvledger.properties.eviction_order_watch import EvictionOrderWatch
from kvledger.properties.lockstep import Lockstep
from kvledger.properties.lockstep_core import ALPHABET, SAMPLE, LockstepCore
from kvledger.properties.machine import EXPECTED_EVENTS, LockstepMachine
from kvledger.properties.machine_base import Progress, run_bound
from kvledger.properties.speculating_scheduler import SPEC_EVENTS

__all__ = ["EXPECTED_SPEC_EVENTS", "MAX_DRAFTS", "SpeculatingLockstepMachine", "run_machine"]

MAX_DRAFTS = 4  # drafts per request per decode, at most: past a page of 4, so rollbacks cross pages
ACCEPT = st.lists(st.integers(0, MAX_DRAFTS), max_size=3)
EXPECTED_SPEC_EVENTS = EXPECTED_EVENTS | SPEC_EVENTS


class SpeculatingLockstepMachine(LockstepMachine):
    """The lockstep machine whose examples speculate (see the module docstring)."""

    @initialize(
        page_size=st.sampled_from([1, 2, 4, 16]),
        num_pages=st.integers(8, 64),
        cache_type=st.sampled_from(["radix", "naive"]),
        table_slots=st.integers(1, 8),
        families=st.lists(st.lists(ALPHABET, min_size=1, max_size=40), min_size=1, max_size=3),
        admission=st.sampled_from(["reserve", "optimistic", "reserve", "adaptive"]),
        reserve_ratio=st.sampled_from([0.0, 0.0, 0.25, 0.5]),
        spec_tokens=st.integers(1, MAX_DRAFTS),
    )
    def setup(
        self,
        page_size: int,
        num_pages: int,
        cache_type: str,
        table_slots: int,
        families: List[List[int]],
        admission: str,
        reserve_ratio: float,
        spec_tokens: int = 1,
    ) -> None:
        LockstepCore.setup(self, page_size, num_pages, cache_type, table_slots, families, admission, reserve_ratio)
        self.header = replace(self.header, spec_tokens=spec_tokens)
        self.lock = Lockstep(self.header)
        if cache_type == "radix":
            self.watch = EvictionOrderWatch(self.ref.cm.prefix_cache, self.note)

    @precondition(lambda self: self.ref.dm.runnable)
    @rule(sample=SAMPLE, accept=ACCEPT)
    def decode(self, sample: List[int], accept: Sequence[int] = ()) -> None:
        self._do({"op": "decode", "sample": sample, "accept": list(accept)})


def run_machine(chosen: settings | None = None, progress: Progress | None = None, seed: int | None = None) -> Progress:
    """`machine.run_machine` for the speculating machine (the zoo runs a speculation bug through it)."""
    progress = progress if progress is not None else Progress()
    chosen = chosen or settings(settings.default, deadline=None, suppress_health_check=list(HealthCheck))
    run_bound(SpeculatingLockstepMachine.bind(progress), chosen, seed)
    return progress
