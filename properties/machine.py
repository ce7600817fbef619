"""Hypothesis state machine: random submit / prefill / decode / finish / abort / evict / probe
sequences applied to reference and fast in lockstep (see `lockstep.py`).

Requests draw tokens from a tiny alphabet over a few shared prefixes, so prefix hits, node
splits, two same-prefix requests prefilling together, eviction under pressure and
rejected-then-admitted requests all happen. Every operation is recorded; a failing run writes
its trace (see `trace.py`) to $KVLEDGER_FAILURES (default .kvledger/failures), so Hypothesis
failures replay and minimize like any other trace.

Every admission policy runs: `reserve` about half the examples, `optimistic` and `adaptive` (the
ratio follows what ended requests generated) a quarter each. Under `reserve` no result ever names a
preemption. Under the other two (reserve_ratio 0, 0.25 or 0.5 to start; 0 most often) the pool
holds at most OPTIMISTIC_POOL_TOKENS, and `submit` clips a request until its worst case fits the
pool (a bigger one is an InvalidOp there). Rules only those examples run push into preemption: `grow` decodes until a
step preempts, `chunk_then_grow` leaves a request mid-chunk first (then continues it),
`outgrown_chunk` does so from idle, where the continuation's step loses its whole batch, `stream`
has short same-prefix requests arrive one per step (several victims in one step), and `drain`
checks liveness: with no new requests, driving the scheduler as the engine does ends every
request within a bound counted from what is outstanding (operations, never time).

`burst` has short requests over related prompts end at their prefill together, the states where
the radix cache's eviction order depends on its bookkeeping (see `EvictionOrderWatch`), and
`invalid` checks that an operation the scheduler must refuse is refused on both sides and changes
nothing. Hypothesis already runs swarm testing over the rules (each example enables a random
subset), so a rule's share varies from example to example.

The rules live by concept: `lockstep_core.py` (the pair, submit / prefill / decode / evict /
probe, the invariants), `optimistic_rules.py`, `radix_order_rules.py` (with
`eviction_order_watch.py`), `refusal_rules.py` and `boundary_rules.py` (requests sized to
admission's and allocation's boundaries from the model's state); finish, abort and the run's
`Progress` are shared with the judge-mode machine (`machine_base.py`). A run reports what it reached to the
`Progress` it is given (`run_machine`, `LockstepMachine.bind`), never to module state.

The Hypothesis profiles (ci, deep, dev) are in `profiles.py`, registered by whoever runs the
machine (tests/conftest.py, the tools), never by importing this module.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from kvledger.properties.boundary_rules import BoundaryRules
from kvledger.properties.eviction_order_watch import EvictionOrderWatch
from kvledger.properties.lockstep_core import ALPHABET, BUDGETS, OPTIMISTIC_POOL_TOKENS, SAMPLE, LockstepCore
from kvledger.properties.machine_base import Progress, failures_dir, run_bound
from kvledger.properties.optimistic_rules import OptimisticRules
from kvledger.properties.radix_order_rules import RadixOrderRules
from kvledger.properties.refusal_rules import RefusalRules, invalid_ops

__all__ = [
    "ALPHABET",
    "BUDGETS",
    "EXPECTED_EVENTS",
    "MACHINE_ONLY_EVENTS",
    "OPTIMISTIC_POOL_TOKENS",
    "SAMPLE",
    "EvictionOrderWatch",
    "LockstepCore",
    "LockstepMachine",
    "Progress",
    "failures_dir",
    "invalid_ops",
    "run_machine",
]

# Rare branches the CI profile must reach (tests/properties/test_lockstep_machine.py proves it).
EXPECTED_EVENTS = frozenset(
    {
        "admission: prefix hit",
        "admission: rejected",
        "admission: rejected only after locking the hit",
        "admission: no table slot",
        "prefill: chunked",
        "radix: node split",
        "radix: one eviction takes several leaves",
        "radix: eviction makes the parent an evictable leaf",
        "allocate: evicts from the prefix cache",
        "cache_req: new prefix inserted",
        "cache_req: duplicate prefix freed while running",
        "cache_req: duplicate prefix freed at finish",
        "cache_req: partial tail page freed",
        "driver: rejected request admitted later",
        "driver: several requests prefill together",
        "driver: abort mid-chunk",
        "driver: idle",
        # optimistic admission (the model's `preemption.py` and the cache scheduler's requeue)
        "preempt: running request",
        "preempt: mid-chunk",
        "preempt: a request of the step's own batch",
        "preempt: a request outside the step's batch",
        "preempt: several victims in one step",
        "preempt: the same request preempted twice",
        "preempt: re-prefill hits the prefix cache",
        "preempt: a preempted request aborted while waiting",
        "driver: every request of a step preempted",
        "driver: drain ended requests that were preempted",
        "adaptive: the reserve ratio changed",
        # the order of eviction (fast keeps its evictable leaves in a heap, see EvictionOrderWatch)
        "radix: eviction after a cached leaf was re-touched",
        "radix: eviction after a leaf gained a child",
        "radix: lock/unlock of an evictable leaf",
    }
)
# noted by this machine alone: the fuzzer's walk has no EvictionOrderWatch
MACHINE_ONLY_EVENTS = frozenset(
    {
        "radix: eviction after a cached leaf was re-touched",
        "radix: eviction after a leaf gained a child",
    }
)
# name -> the number of the sequence (1 = the first the run generated) that first reached it


class LockstepMachine(OptimisticRules, RadixOrderRules, RefusalRules, BoundaryRules):
    """The lockstep machine: `LockstepCore`'s plain rules and invariants, the optimistic-admission
    rules, the radix eviction-order rules and the refused operations. Hypothesis collects the rules
    of every base by name, so how they are split over modules changes nothing it generates.

    Run it through `run_machine(chosen, progress)`, or `LockstepMachine.bind(progress)` where a
    caller needs the class (a seed, a patched method): the bound class reports what the run
    reached to `progress`."""


def run_machine(chosen: settings | None = None, progress: Progress | None = None, seed: int | None = None) -> Progress:
    """Run the state machine as the test suite does (`run_bound`), under `chosen` or else the
    loaded profile (as the TestCase's own settings: no deadline, no health check) and `seed` (else
    the profile's: derandomized under ci), reporting to `progress` (else a new one); returns the
    progress, raises the failure, if any. `kvledger check` runs it through `machines.machine_run`."""
    progress = progress if progress is not None else Progress()
    chosen = chosen or settings(settings.default, deadline=None, suppress_health_check=list(HealthCheck))
    run_bound(LockstepMachine.bind(progress), chosen, seed)
    return progress
