"""The checker's one seam: a `Target` is what the checker runs a trace on.

replay, minimize and explore are written once over a Target (show over a lockstep one: a subject's
View names no page owner), and the CLI builds the target once from --subject, --fix and --bug:

  LockstepTarget   reference against fast (`lockstep.py`), optionally with a zoo bug of fast
                   patched in; the whole observable state of both sides is compared after every
                   operation
  SubjectTarget    one subject in judge mode (`subject_driver.py`, or `scheduling_driver.py`
                   for a subject that schedules itself: `drivers.py`): the judge after every
                   operation; built from a factory (the checker builds it from a spec, with the
                   source edits of a --fix or --bug)

A target starts a `Run` for a trace header: a fresh driver that applies typed trace lines
(`OpRecord`: a `CacheOp` and its optional `expect`) one at a time, returns what each did
(`OpResult`) and raises the one failure type (`Finding`, its step and operation set) or
`InvalidOp` for an operation that makes no sense at its point (nothing changed). The two drivers
stay two because they read different state: lockstep compares two `CacheScheduler`s it can see
into, judge mode sees a subject only through its `View`; both reach an operation's method through
the one `ops.dispatch`.

A target also carries its `Isolation` (`isolation.py`): whether the commands run it in a child
process (`kvledger/checker/sandbox.py`), where a subject that dies is a finding with its trace.
Subjects are isolated by default; lockstep, kvledger's own two managers, is not.

A target also says what a trace it writes records (`trace_header`): the producer, and for a
subject its spec and version, so that `kvledger replay` finds the subject again.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import replace
from typing import Any, Callable, ContextManager, List, Optional, Protocol, Sequence, Tuple

from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import InvalidOp, OpRecord, OpResult, TraceLine, as_record
from kvledger.engine.ledger.trace import Header
from kvledger.properties import write_ahead
from kvledger.properties.drivers import Driver, driver_for
from kvledger.properties.isolation import IN_PROCESS, ISOLATED, Isolation
from kvledger.properties.lockstep import Lockstep
from kvledger.properties.subject import Subject, SubjectConfig, SubjectUnavailable, config_of, header_of
from kvledger.properties.subject_calls import raised

__all__ = [
    "Finding",
    "InvalidOp",
    "LockstepTarget",
    "Run",
    "SubjectRun",
    "SubjectTarget",
    "Target",
    "config_of",
    "header_of",
    "replay",
]

Patch = Callable[[Optional[str]], ContextManager[Any]]


class Run(Protocol):
    """One trace being applied: `ops` are the lines applied so far (the failing one included);
    `step` the 1-based number of the last operation tried (a Finding names it). `apply` takes an
    OpRecord or a bare CacheOp (a dict trace line is parsed once at the entry, while callers that
    still build dicts remain)."""

    ops: List[OpRecord]
    step: int

    def apply(self, line: TraceLine) -> OpResult: ...

    def copy(self) -> Run: ...


class Target(Protocol):
    """What the checker runs traces on (see the module docstring)."""

    name: str  # "lockstep" or the subject's spec text, for messages
    isolation: Isolation  # how its runs are kept from taking the checker down (`isolation.py`)
    bug: Optional[str]  # the planted bug it runs with, if any
    strict: bool  # an invalid operation is a bad trace (lockstep); else it is skipped (subjects)

    def active(self) -> ContextManager[Any]:
        """Whatever must hold while runs are applied (lockstep: the zoo bug patched into fast)."""
        ...

    def start(self, header: Header) -> Run:
        """A fresh run for `header`; a Finding if the subject fails as it is built."""
        ...

    def trace_header(self, header: Header, producer: str) -> Header:
        """`header` as a trace this target wrote records it."""
        ...


# -- lockstep: reference against fast ----------------------------------------------------------------
class LockstepTarget:
    """Reference against fast. `bug` names a zoo bug of fast, patched in by `patch` (the checker
    passes `kvledger.subjects.fast_zoo.patched`) while `active`; `device` is where fast's tensors live;
    `speculate`: the machine and the fuzzer draw speculating runs (headers with `spec_tokens`)."""

    strict = True

    def __init__(
        self,
        bug: Optional[str] = None,
        device: str = "cpu",
        patch: Optional[Patch] = None,
        speculate: bool = False,
        isolation: Isolation = IN_PROCESS,
    ) -> None:
        if bug is not None and patch is None:
            raise ValueError("a lockstep target with a bug needs the patch that plants it")
        self.name = "lockstep"
        self.isolation = isolation
        self.bug = bug
        self.device = device
        self._patch = patch
        self.speculate = speculate

    def active(self) -> ContextManager[Any]:
        return self._patch(self.bug) if self._patch is not None else contextlib.nullcontext()

    def start(self, header: Header) -> Lockstep:
        return Lockstep(header, self.device)

    def trace_header(self, header: Header, producer: str) -> Header:
        return replace(header, producer=producer)


# -- judge mode: one subject -------------------------------------------------------------------------
class SubjectRun:
    """A SubjectDriver applying trace lines: a Finding out of it gets the step and the operation."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.ops: List[OpRecord] = []
        self.step = 0

    def apply(self, line: TraceLine) -> OpResult:
        record = as_record(line)
        try:
            result = self.driver.apply(record)
        except InvalidOp:
            raise
        except Finding as f:
            self.ops.append(record)
            self.step = len(self.ops)
            f.at(self.step, record.to_json())
            raise
        self.ops.append(record)
        self.step = len(self.ops)
        return result

    def copy(self) -> SubjectRun:
        """A deep copy, subject included (not every subject can be copied: that raises)."""
        return copy.deepcopy(self)


class SubjectTarget:
    """One subject in judge mode. `factory` builds it for a pool (with any source edits already
    in it); `name` is its spec text, `bug` the zoo bug or `fix` the fix its edits apply."""

    strict = False

    def __init__(
        self,
        factory: Callable[[SubjectConfig], Subject],
        name: str,
        *,
        bug: Optional[str] = None,
        fix: Optional[str] = None,
        page_sizes: Sequence[int] = (1, 2, 4),
        on_event: Optional[Callable[[str], None]] = None,
        isolation: Isolation = ISOLATED,
    ) -> None:
        self.factory = factory
        self.isolation = isolation
        self.name = name
        self.bug = bug
        self.fix = fix
        self.page_sizes = tuple(page_sizes)
        self.on_event = on_event
        self.version = "unknown"  # known once a subject was built

    def active(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def subject(self, config: SubjectConfig) -> Subject:
        """A fresh subject; a Finding if building it fails (SubjectUnavailable propagates)."""
        write_ahead.starting(header_of(config, None, "kvledger", self.name, ""))
        try:
            subject = self.factory(config)
        except (SubjectUnavailable, Finding):
            raise
        except Exception as e:
            raise raised(e, "building the subject") from e
        self.version = getattr(subject, "version", "unknown")
        return subject

    def start(self, header: Header) -> SubjectRun:
        return self.start_config(config_of(header))

    def start_config(self, config: SubjectConfig, on_event: Optional[Callable[[str], None]] = None) -> SubjectRun:
        return SubjectRun(driver_for(self.subject(config), config, on_event=on_event or self.on_event))

    def trace_header(self, header: Header, producer: str) -> Header:
        return header_of(config_of(header), header.seed, producer, self.name, self.version)


# -- replaying a trace on a target ---------------------------------------------------------------------
def replay(target: Target, header: Header, ops: Sequence[TraceLine]) -> Tuple[Optional[Finding], Run | None]:
    """Apply `ops` to a fresh run of `target`: the first Finding (None if none) and the run (None
    when building it failed). A strict target raises InvalidOp (with `.step`) at an invalid
    operation; otherwise the operation is skipped, as a fuzzer never records one. Call it inside
    `target.active()`."""
    try:
        run = target.start(header)
    except Finding as f:
        if target.strict:
            raise
        return f, None
    for op in ops:
        try:
            run.apply(op)
        except InvalidOp as e:
            if target.strict:
                e.step = len(run.ops) + 1  # type: ignore[attr-defined]
                raise
        except Finding as f:
            return f, run
    return None, run


def applied(run: Run | None) -> List[OpRecord]:
    """The operations a run applied (none when it was never built)."""
    return [] if run is None else list(run.ops)
