"""One fuzz case: the `Workload` seam (what differs between a lockstep and a subject target) and the
case loop written once over it (start a run, walk it, judge each operation within its time limit).

`fuzz.py` runs cases in worker processes; campaigns, the zoo and tests run one with `play_case`.
"""

from __future__ import annotations

import signal
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Set, Tuple

from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import OpRecord
from kvledger.engine.ledger.trace import Header
from kvledger.properties.subject import SubjectConfig
from kvledger.properties.target import Run, config_of

OP_LIMIT_S = 10.0  # an operation still running after this long is reported as a hang


class Workload(Protocol):
    """How the fuzzer walks one kind of target (see the module docstring)."""

    producer: str  # what the traces it writes name as their producer
    stops_at_first: bool  # the first finding ends the run (else: the first of each kind is kept)
    zoo_cases: int  # the zoo's default budget of fuzz cases per bug
    zoo_minimize: Tuple[float, int]  # the zoo's budget to minimize a catch: seconds, replays

    def prepare(self) -> None:
        """Anything to build or check once before the workers start (fails early, in one line)."""
        ...

    def case_seed(self, seed: int, worker: int, workers: int, case: int) -> int: ...

    def task_seed(self, seed: int, shard: int, case: int) -> int:
        """The seed of case `case` of campaign task `shard`."""
        ...

    def header(self, cseed: int) -> Header:
        """The pool of case `cseed`."""
        ...

    def start(self, header: Header, note: Callable[[str], None]) -> Run:
        """A fresh run for the case; `note` hears the rare events it reaches."""
        ...

    def walk(self, run: Any, cseed: int, note: Callable[[str], None], keep_going: Callable[[], bool]) -> Iterator[None]:
        """The case's operations applied to `run`, one per iteration; a Finding propagates."""
        ...

    def preemptions(self, run: Any) -> int: ...

    def expected_events(self) -> Set[str]:
        """The rare events a run should reach (empty: none are listed)."""
        ...

    def trace_paths(self, out_dir: Path, seed: int, worker: int, case: int, cseed: int, kind: str) -> Tuple[Path, Path]:
        """Where a failing trace and its minimized trace go."""
        ...

    def minimizes(self, kind: str) -> bool: ...

    def minimize(
        self, header: Header, ops: List[OpRecord], kind: str, budget: float, replays: Optional[int], log: Any
    ) -> Tuple[Header, List[OpRecord], str]:
        """The failing trace made small (header, operations, kind), inside `target.active()`."""
        ...

    def replay_hint(self) -> str: ...


# -- one case ----------------------------------------------------------------------------------------
class OpTimeout(Exception):
    """One operation ran past its time limit (a buggy method looping forever, say)."""


def _raise_timeout(signum: int, frame: Any) -> None:
    raise OpTimeout


def limited_steps(steps: Iterator[None], seconds: float) -> Iterator[None]:
    """Advance `steps` one at a time, each within `seconds` of wall time (SIGALRM, main thread of
    a Unix process); a step past it raises OpTimeout."""
    old = signal.signal(signal.SIGALRM, _raise_timeout)
    try:
        while True:
            signal.setitimer(signal.ITIMER_REAL, seconds)
            try:
                next(steps)
            except StopIteration:
                return
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            yield
    finally:
        signal.signal(signal.SIGALRM, old)


@dataclass
class CaseOutcome:
    """One case as it ran: its pool, the operations it recorded (the failing one included), the
    operations that ran clean (`steps`: what the counts count), the rare events it reached, and its
    finding (kind "hang" or "crash" when the code under test looped or raised outside what the
    driver judges)."""

    number: int
    seed: int
    header: Header
    ops: List[OpRecord] = field(default_factory=list)
    events: Set[str] = field(default_factory=set)
    finding: Optional[Finding] = None
    preemptions: int = 0
    steps: int = 0

    @property
    def config(self) -> SubjectConfig:
        return config_of(self.header)


def play_case(
    workload: Workload,
    number: int,
    cseed: int,
    keep_going: Callable[[], bool] = lambda: True,
    op_limit: float = OP_LIMIT_S,
    tick: Optional[Callable[[Any], None]] = None,
) -> CaseOutcome:
    """Case `cseed` (the `number`th of its worker) from start to end, or until `keep_going` says
    stop; `tick` sees the run after every operation. Call it inside `target.active()`."""
    outcome = CaseOutcome(number, cseed, workload.header(cseed))
    try:
        run = workload.start(outcome.header, outcome.events.add)
    except Finding as f:  # a subject that fails as it is built
        outcome.finding = f
        return outcome
    try:
        for _ in limited_steps(workload.walk(run, cseed, outcome.events.add, keep_going), op_limit):
            outcome.steps += 1
            if tick is not None:
                tick(run)
    except OpTimeout:
        last = _op_name(run.ops[-1]) if run.ops else None
        outcome.finding = Finding("hang", f"operation {len(run.ops)} ({last}) ran past {op_limit:g} s")
    except Finding as f:
        outcome.finding = f
    except Exception:  # a crash of the code under test, outside what the driver judges
        outcome.finding = Finding("crash", traceback.format_exc())
    outcome.ops = list(run.ops)
    outcome.preemptions = workload.preemptions(run)
    return outcome


def _op_name(line: Any) -> str:
    """The operation's name, for a trace line as a dict or typed (`ops.OpRecord`)."""
    return str(line.get("op") if isinstance(line, dict) else line.name)


def as_json(line: Any) -> Dict[str, Any]:
    """A trace line as its JSON object (a campaign's outcome is stored as JSON)."""
    return line if isinstance(line, dict) else dict(line.to_json())
