"""What both Hypothesis state machines share: the run's `Progress`, the `DriverMachine` base and
`run_bound`, which runs a bound machine as the test suite does.

There are two machines because there are two targets (`target.py`), and they stay two classes
because they read different state: `machine.LockstepMachine` runs the
reference and fast `CacheScheduler`s side by side, `subject_machine.SubjectMachine` runs one
subject through the `SubjectDriver`. Both generate submit / prefill / decode / finish / abort /
evict sequences over a driver's waiting and running requests; this base holds the part that does
not depend on the target: which requests can finish or be aborted (and the two rules that draw
them), the progress of the run (its last failing sequence included), and where a failing trace
goes. `machines.py` says which machine checks which target.

A Hypothesis machine is a class that Hypothesis instantiates with no arguments, once per
sequence, so a run's `Progress` cannot be passed to the constructor: `bind(progress)` makes a
subclass that carries it, and each instance reports to it. An unbound machine (run directly by
`run_state_machine_as_test`, as the mutation and invariant audits do) reports to a fresh
`Progress` per sequence that nobody reads.

A machine's class source is part of the run: Hypothesis derives a derandomized run's seed from it
(`function_digest` of the class, found by name in its module), so the text of `LockstepMachine`
stays as it is unless a run is meant to change (its bases are free); the judge-mode run pins its
seed instead (`subject_machine.SUBJECT_CI_SEED`). Hypothesis also draws some values from the
literals of every local module loaded, so a run imports only its own machine (`machines.py`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple, TypeVar, Union

import hypothesis
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from kvledger.engine.ledger.ops import OpResult, TraceLine
from kvledger.engine.ledger.trace import Header
from kvledger.properties.subject import SubjectConfig

# The last failing sequence of a run: the trace header (lockstep) or the pool (judge mode) it ran
# on, its operations up to the failing one, and the failure (a Finding, or a property of the run).
LastFailure = Tuple[Union[Header, SubjectConfig], Sequence[TraceLine], AssertionError]


class Progress:
    """What one run of a machine reached, in counts (never time): `sequences` started so far (1 =
    the run's first), `reached` (rare event -> the number of the sequence that first reached it)
    and `last_failure` (`LastFailure`: when Hypothesis shrinks, it replays the shrunk one last)."""

    def __init__(self) -> None:
        self.sequences = 0
        self.reached: Dict[str, int] = {}
        self.last_failure: Optional[LastFailure] = None

    def start_sequence(self) -> None:
        self.sequences += 1

    def note(self, name: str) -> None:
        """A rare event of the current sequence: recorded with its sequence if it is the first,
        and shown by Hypothesis' statistics."""
        self.reached.setdefault(name, self.sequences)
        event(name)


def failures_dir() -> Path:
    return Path(os.environ.get("KVLEDGER_FAILURES", ".kvledger/failures"))


M = TypeVar("M", bound="DriverMachine")


class DriverMachine(RuleBasedStateMachine):
    """The rules both targets share: `finish` draws a running request, `abort` a waiting or a
    running one, each enabled only when there is one to draw. A subclass says which requests those
    are (`waiting_uids`, `running_uids`: the two drivers keep them differently), applies an
    operation (`_do`) and adds its own submit / prefill / decode / evict rules, whose strategies
    differ on purpose: the lockstep ones are tuned to push the reference's pools into preemption
    and eviction, the judge-mode ones draw prompts as the subject fuzzer does."""

    bound_progress: ClassVar[Optional[Progress]] = None

    def __init__(self) -> None:
        super().__init__()
        self.progress: Progress = type(self).bound_progress or Progress()

    @classmethod
    def bind(cls: type[M], progress: Progress) -> type[M]:
        """This machine reporting to `progress` (a subclass of the same name: Hypothesis keys its
        derandomized seed on the class's source, which the subclass shares)."""
        return type(cls.__name__, (cls,), {"bound_progress": progress, "__module__": cls.__module__})

    def note(self, name: str) -> None:
        self.progress.note(name)

    def waiting_uids(self) -> List[int]:
        """The requests waiting for admission, head first."""
        raise NotImplementedError

    def running_uids(self) -> List[int]:
        """The admitted requests, in admission order."""
        raise NotImplementedError

    def _do(self, op: Dict[str, Any]) -> OpResult:
        raise NotImplementedError

    def _before_abort(self, uid: int) -> None:
        """Called with the uid `abort` drew, before the operation runs."""

    @precondition(lambda self: bool(self.running_uids()))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        uid = data.draw(st.sampled_from(self.running_uids()), label="uid")
        self._do({"op": "finish", "uid": uid})

    @precondition(lambda self: bool(self.waiting_uids() or self.running_uids()))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        uid = data.draw(st.sampled_from(self.waiting_uids() + self.running_uids()), label="uid")
        self._before_abort(uid)
        self._do({"op": "abort", "uid": uid})


def run_bound(machine: type[DriverMachine], chosen: settings, seed: Optional[int] = None) -> None:
    """Run `machine` (bound to its progress) as the test suite does, through its TestCase, under
    `chosen` and `seed` (else the settings': derandomized under ci); raises the failure, if any. A
    TestCase class keeps the settings it was made with, so they are set here, not left to whenever
    it was first touched."""
    if seed is not None:
        hypothesis.seed(seed)(machine)
    case = machine.TestCase
    case.settings = chosen
    case("runTest").runTest()
