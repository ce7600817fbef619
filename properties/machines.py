"""Which Hypothesis machine checks a target: `machine_run(target, progress, profile, examples)`.

There are two machines because the two targets read different state (see `machine_base.py`):
`machine.LockstepMachine` draws its operations from the reference's own `CacheScheduler`,
`subject_machine.SubjectMachine` from the `SubjectDriver`'s queues (a subject is opaque behind its
View). Both are `DriverMachine`s reporting to a `Progress`; everything else that differs per
target is said here, once, as a `MachineRun`:

  machine    the LockstepMachine (the target's zoo bug is patched into fast while the target is
             `active()`; the SpeculatingLockstepMachine when the target speculates), or the
             SubjectMachine over the target's factory and page sizes
  expected   the rare events a run should reach: `machine.EXPECTED_EVENTS`, or those the
             subject's capabilities make reachable (`subject_events.expected_events`)
  settings   lockstep: the profile's; judge mode: its own counts per profile (`SUBJECT_EXAMPLES`,
             `SUBJECT_STEPS`) with Hypothesis' shrinking off, as over a real subject it took
             minutes where kvledger's minimizer takes seconds
  failure    the run's last failing sequence as a trace header, its operations and what failed

A command runs a target's machine through `MachineRun.run` inside `target.active()`.

Each machine's module is imported only when a target needs it: Hypothesis draws some integers
and floats from the literals of every local module loaded (its "local constants"), so importing
the judge-mode machine's modules (whose literals include 0.1) would change the values a seeded
lockstep run draws, and with them the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, List, Optional

from hypothesis import HealthCheck, Phase, settings

from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import TraceLine
from kvledger.engine.ledger.trace import Header
from kvledger.properties.machine_base import DriverMachine, Progress, run_bound
from kvledger.properties.subject import SubjectConfig
from kvledger.properties.target import LockstepTarget, SubjectTarget, Target, header_of

__all__ = ["Failure", "MachineRun", "machine_run"]


@dataclass(frozen=True)
class Failure:
    """A run's failing sequence as a trace: `header` as the machine ran it (producer "hypothesis"),
    the operations up to the failing one, and the failure: a Finding, or a property of the run (a
    plain AssertionError, kind "property")."""

    header: Header
    ops: List[TraceLine]
    error: AssertionError

    @property
    def kind(self) -> str:
        return self.error.kind if isinstance(self.error, Finding) else "property"

    @property
    def message(self) -> str:
        return self.error.message if isinstance(self.error, Finding) else str(self.error)


@dataclass(frozen=True)
class MachineRun:
    """A target's Hypothesis machine, bound to the run's `progress` (see the module docstring);
    `title` names the target in reports."""

    machine: type[DriverMachine]
    progress: Progress
    expected: FrozenSet[str]
    settings: settings
    title: str
    target: Target
    pinned_seed: Optional[int] = None  # a derandomized run's seed, when the machine pins one

    def run(self, seed: Optional[int] = None, shrink: bool = True) -> None:
        """One run under the settings and `seed` (else the settings': derandomized under ci);
        `shrink=False` stops at the first failing sequence. Raises the failure, if any. Call it
        inside `target.active()`."""
        chosen = self.settings
        if seed is None and chosen.derandomize:
            seed = self.pinned_seed
        if not shrink:
            chosen = settings(chosen, phases=[p for p in chosen.phases if p is not Phase.shrink])
        run_bound(self.machine, chosen, seed)

    def failure(self) -> Optional[Failure]:
        """The last failing sequence the machine recorded (None if none)."""
        last = self.progress.last_failure
        if last is None:
            return None
        where, ops, error = last
        if isinstance(where, SubjectConfig):
            version = getattr(self.target, "version", "unknown")
            where = header_of(where, None, "hypothesis", self.target.name, version)
        return Failure(where, list(ops), error)


def machine_run(target: Target, progress: Progress, profile: str, examples: Optional[int] = None) -> MachineRun:
    """The machine that checks `target` under the loaded Hypothesis profile `profile` (with
    `examples` sequences instead of the profile's), reporting to `progress`. A subject is built
    once here, on a small pool, for its capabilities and version (inside `target.active()`)."""
    if isinstance(target, LockstepTarget):
        base = settings.default
        assert base is not None  # the loaded profile
        chosen = settings(base, max_examples=examples) if examples else base
        if target.speculate:
            from kvledger.properties.speculation_machine import EXPECTED_SPEC_EVENTS, SpeculatingLockstepMachine

            speculating = SpeculatingLockstepMachine.bind(progress)
            title = f"{target.name} (speculating)"
            return MachineRun(speculating, progress, EXPECTED_SPEC_EVENTS, chosen, title, target)
        from kvledger.properties.machine import EXPECTED_EVENTS, LockstepMachine

        return MachineRun(LockstepMachine.bind(progress), progress, EXPECTED_EVENTS, chosen, target.name, target)
    if isinstance(target, SubjectTarget):
        from kvledger.properties.subject_events import expected_events
        from kvledger.properties.subject_machine import SUBJECT_CI_SEED, SUBJECT_EXAMPLES, SUBJECT_STEPS, machine_for

        sample = target.subject(SubjectConfig(num_pages=8, page_size=target.page_sizes[0], max_seq_len=16))
        chosen = settings(
            settings.default,
            max_examples=examples or SUBJECT_EXAMPLES[profile],
            stateful_step_count=SUBJECT_STEPS[profile],
            deadline=None,
            suppress_health_check=list(HealthCheck),
            print_blob=False,
            report_multiple_bugs=False,
            phases=[Phase.explicit, Phase.reuse, Phase.generate],
        )
        caps = sample.capabilities
        machine = machine_for(target.factory, progress, target.page_sizes, getattr(caps, "spec_tokens", 0))
        title = f"{target.name} ({target.version})"
        expected = frozenset(expected_events(caps, len(sample.view().groups))) | getattr(sample, "rare_events", set())
        return MachineRun(machine, progress, expected, chosen, title, target, SUBJECT_CI_SEED)
    raise TypeError(f"no Hypothesis machine checks a {type(target).__name__}")
