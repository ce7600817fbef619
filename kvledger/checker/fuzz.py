"""`kvledger fuzz`: random walks over a `Target` (`properties/target.py`), written once.

What differs between reference against fast and a subject in judge mode is how the next operation
is chosen from the run's state, and that is the target's `Workload`:

  LockstepWorkload  (`checker/lockstep_walk.py`) reads the reference CacheScheduler: edge-weighted
                    configurations, a few hundred operations, refusal checks, liveness under
                    optimistic admission; the first divergence ends the run
  SubjectWorkload   (`checker/subject_walk.py`) reads the driver's view of the subject: prompt
                    stems cut at page boundaries, 40 operations and a drain; the first finding of
                    each kind is kept and the run goes on

Everything else is here, once: a case (`play_case`: start, walk, each operation within a time
limit, a Finding, a hang or a crash as its outcome), worker processes that run cases until the
seconds or `max_cases` are spent, the failing trace written with the target's header, minimized
by the workload, and one result with one report. Case k of worker w under seed s comes from a
seed the workload derives from (s, w, k) alone, so the same seed and workers give the same cases;
`max_cases` makes the amount of work machine-independent too (the seconds are only a budget).
"""

from __future__ import annotations

import copy
import logging
import multiprocessing as mp
import queue as queue_mod
import shutil
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from kvledger.checker.fuzz_case import (
    OP_LIMIT_S,
    CaseOutcome,
    Workload,
    play_case,
)
from kvledger.checker.isolated_runs import died_outcome, replay_isolated
from kvledger.checker.sandbox import send
from kvledger.checker.workloads import workload_for
from kvledger.engine.ledger import trace
from kvledger.engine.ledger.ops import OpRecord
from kvledger.engine.ledger.trace import Header
from kvledger.properties import write_ahead
from kvledger.properties.isolation import IN_PROCESS, ISOLATED, Isolation, is_death
from kvledger.properties.target import Target

log = logging.getLogger(__name__)
Op = OpRecord

REPORT_EVERY = 0.25  # seconds between a worker's progress messages
PROGRESS_EVERY = 5.0  # seconds between the progress lines logged (INFO)


# -- the target a worker process rebuilds -------------------------------------------------------------
@dataclass(frozen=True)
class TargetRecipe:
    """What a worker process rebuilds the target from (a subject's factory does not pickle)."""

    subject: Optional[str]
    fix: Optional[str] = None
    bug: Optional[str] = None
    device: str = "cpu"
    edits: Optional[Tuple[Any, ...]] = None
    speculate: bool = False  # lockstep: speculating cases
    isolation: Optional[Isolation] = None  # None: the kind's default (a subject isolated, lockstep not)

    @staticmethod
    def of(target: Any) -> TargetRecipe:
        from kvledger.properties.target import LockstepTarget

        if isinstance(target, LockstepTarget):
            return TargetRecipe(
                None, bug=target.bug, device=target.device, speculate=target.speculate, isolation=target.isolation
            )
        if hasattr(target, "spec"):  # checker/targets.py's SpecTarget
            return TargetRecipe(
                target.name, target.fix, target.bug, edits=tuple(target.edits), isolation=target.isolation
            )
        raise ValueError(f"{target.name}: a target built from a factory alone cannot run in worker processes")

    def build(self) -> Any:
        from kvledger.checker.targets import lockstep_target, subject_target

        if self.subject is None:
            return lockstep_target(self.bug, self.device, self.speculate, self.isolation or IN_PROCESS)
        return subject_target(
            self.subject, fix=self.fix, bug=self.bug, edits=self.edits, isolation=self.isolation or ISOLATED
        )


# -- what a worker tells the parent (through a multiprocessing queue) ----------------------------------
@dataclass
class Ready:
    worker: int


@dataclass
class Progress:
    worker: int
    ops: int
    cases: int
    events: Dict[str, int]  # rare event -> the cases that reached it, since the last report
    preemptions: int = 0  # requests preempted since the last report
    optimistic_cases: int = 0  # optimistic cases run since the last report


@dataclass
class CaseStarted:
    worker: int
    case: int
    seed: int


@dataclass
class Done:
    worker: int
    cases: int  # the cases it started
    reason: str  # why it stopped


@dataclass
class WorkerFailure:
    worker: int
    case_no: int
    case_seed: int
    header: Dict[str, Any]
    ops: List[Op]
    kind: str  # the finding's kind, "crash" or "hang"
    detail: str  # its message (a crash: the traceback)
    step: Optional[int] = None
    traceback: str = ""  # the subject's traceback, if it raised


def _failure(worker: int, outcome: CaseOutcome) -> WorkerFailure:
    f = outcome.finding
    assert f is not None
    step = f.step if f.step is not None else len(outcome.ops)
    return WorkerFailure(
        worker, outcome.number, outcome.seed, asdict(outcome.header), outcome.ops, f.kind, f.message, step, f.detail
    )


def _worker(
    index: int,
    recipe: TargetRecipe,
    seed: int,
    workers: int,
    seconds: float,
    out: Any,
    stop: Any,
    op_limit: float = OP_LIMIT_S,
    admission: Optional[str] = None,
    max_cases: Optional[int] = None,
    record: Optional[str] = None,
) -> None:
    """A worker process: builds the target, then runs its cases in the target's sandbox, one child
    at a time. A child that dies leaves its case's finding (`sandbox.SubjectDied`) and the next
    child goes on from the following case. With isolation off the cases run here, recording at
    `record`, so that the parent can report a death of this process with its trace."""
    import torch

    from kvledger.checker import sandbox

    torch.set_num_threads(1)  # tiny tensors; workers share the cores
    target = recipe.build()
    workload = workload_for(target, admission)
    if record is not None and not target.isolation.enabled:
        write_ahead.open_log(record)
    # the clock starts once imports are done: a loaded machine may take seconds to spawn us
    deadline = time.monotonic() + seconds
    out.put(Ready(index))

    def keep_going() -> bool:
        return not stop.is_set() and time.monotonic() < deadline

    kinds: Set[str] = set()  # the kinds of finding this worker reported
    in_flight: List[CaseStarted] = []

    def relay(message: Any) -> None:
        if isinstance(message, CaseStarted):
            in_flight[:] = [message]
            if record is not None and not target.isolation.enabled:
                # the queue's writes are asynchronous: a death here would lose the message
                Path(record + ".case").write_text(f"{message.case} {message.seed}")
        elif isinstance(message, WorkerFailure):
            kinds.add(message.kind)
        out.put(message)

    number, reason = 0, "stopped by the parent"
    with target.active():
        while True:
            try:
                number, reason = sandbox.call(
                    target.isolation,
                    _cases,
                    index,
                    workload,
                    seed,
                    workers,
                    number,
                    max_cases,
                    set(kinds),
                    keep_going,
                    op_limit,
                    on_message=relay,
                )
                if reason == "time budget spent" and stop.is_set():
                    reason = "stopped by the parent (the run ended)"
                break
            except sandbox.SubjectDied as died:
                case = in_flight[0]
                outcome = died_outcome(workload, case.case, case.seed, died)
                out.put(Progress(index, len(outcome.ops), 0 if workload.stops_at_first else 1, {}))
                if died.kind not in kinds:
                    kinds.add(died.kind)
                    out.put(_failure(index, outcome))
                number = case.case + 1
                if workload.stops_at_first:
                    reason = "stopped at its first finding (its subject died)"
                    break
                if max_cases is not None and number >= max_cases:
                    reason = f"ran its {max_cases} cases"
                    break
                if not keep_going():
                    reason = "stopped by the parent (the run ended)" if stop.is_set() else "time budget spent"
                    break
    out.put(Done(index, number, reason))


def _cases(
    index: int,
    workload: Workload,
    seed: int,
    workers: int,
    first: int,
    max_cases: Optional[int],
    kinds: Set[str],
    keep_going: Callable[[], bool],
    op_limit: float,
) -> Tuple[int, str]:
    """Cases `first`, `first + 1`, ... of worker `index` until the budget, `max_cases` or a finding
    that stops the run; every report goes out through `sandbox.send`. Returns the next case's
    number and why it stopped."""
    events: Dict[str, int] = {}
    ops = cases = preemptions = optimistic_cases = 0
    last = time.monotonic()

    def flush(force: bool = False) -> None:
        nonlocal ops, cases, preemptions, optimistic_cases, last
        now = time.monotonic()
        if force or now - last >= REPORT_EVERY:
            send(Progress(index, ops, cases, dict(events), preemptions, optimistic_cases))
            events.clear()
            ops = cases = preemptions = optimistic_cases = 0
            last = now

    counted = [0]  # of this case's preemptions, those already counted

    def tick(run: Any) -> None:
        nonlocal ops, preemptions
        ops += 1
        preemptions += workload.preemptions(run) - counted[0]
        counted[0] = workload.preemptions(run)
        flush()

    number = first
    while True:
        if not keep_going():
            flush(force=True)
            return number, "time budget spent"
        if max_cases is not None and number >= max_cases:
            flush(force=True)
            return number, f"ran its {max_cases} cases"
        counted[0] = 0
        cseed = workload.case_seed(seed, index, workers, number)
        send(CaseStarted(index, number, cseed))
        outcome = play_case(workload, number, cseed, keep_going, op_limit, tick)
        for name in outcome.events:
            events[name] = events.get(name, 0) + 1
        # the counts are of the cases and operations the run finished: a finding that stops the
        # run leaves its case unfinished, one that does not ends its case with the failing operation
        if outcome.finding is None or not workload.stops_at_first:
            cases += 1
            optimistic_cases += outcome.header.policy.preempts
            ops += len(outcome.ops) - outcome.steps
        number += 1
        flush(force=True)  # per case: a child that dies in the next case loses nothing of this one
        if outcome.finding is not None:
            if outcome.finding.kind not in kinds:
                kinds.add(outcome.finding.kind)
                send(_failure(index, outcome))
            if workload.stops_at_first:
                return number, "stopped at its first finding"


# -- the parent -----------------------------------------------------------------------------------------
@dataclass
class FuzzFailure:
    kind: str  # the finding's kind, "crash" or "hang"
    step: int
    detail: str
    worker: int
    case: int
    trace_path: Path
    case_seed: Optional[int] = None
    minimized_path: Optional[Path] = None
    minimized_ops: Optional[int] = None
    minimized_kind: Optional[str] = None
    minimized_traceback: str = ""  # the minimized trace's own, from a replay of it
    traceback: str = ""  # the failing run's (the subject's, or the stack its process died with)


@dataclass
class FuzzResult:
    ops: int
    cases: int
    seconds: float
    workers: int
    seed: int
    bug: Optional[str] = None
    events: Dict[str, int] = field(default_factory=dict)  # rare event -> the cases that reached it
    failures: List[FuzzFailure] = field(default_factory=list)  # the first of each kind
    seconds_to_find: Optional[float] = None  # from the first worker ready to the first failure
    preemptions: int = 0  # requests preempted, over every case run
    optimistic_cases: int = 0  # cases finished under optimistic admission
    target: str = "lockstep"
    expected: Set[str] = field(default_factory=set)  # the rare events listed in the report
    hint: str = ""  # how to replay a finding, when the target needs more than its trace
    stops: List[WorkerStop] = field(default_factory=list)  # how each worker ended
    first_found: Optional[Tuple[int, int]] = None  # (worker, case) of the first finding to arrive

    @property
    def incomplete(self) -> bool:
        """A worker ended early: "no finding" would speak for cases that never ran."""
        return any(s.early for s in self.stops)

    @property
    def failure(self) -> Optional[FuzzFailure]:
        return self.failures[0] if self.failures else None

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else 0.0

    @property
    def exit_code(self) -> int:
        if not self.failures:
            return 3 if self.incomplete else 0
        return 2 if self.failures[0].kind == "crash" else 1  # a hang is a bug in the code under test


def _progress_line(elapsed: float, seconds: float, ops: int, cases: int, reached: Set[str], expected: Set[str]) -> str:
    rate = ops / elapsed if elapsed > 0 else 0.0
    return (
        f"fuzz {elapsed:5.1f}/{seconds:g}s  {ops:,} ops ({rate:,.0f} ops/s)  {cases:,} cases  "
        f"events {len(reached & expected)}/{len(expected)} (+{len(reached - expected)} other)"
    )


def fuzz(
    seconds: float,
    workers: int = 1,
    seed: int = 0,
    out_dir: str | Path = ".kvledger/fuzz",
    bug: Optional[str] = None,
    progress: bool = True,
    minimize_budget: float = 60.0,
    admission: Optional[str] = None,
    max_cases: Optional[int] = None,
    minimize_replays: Optional[int] = None,
    target: Optional[Target] = None,
) -> FuzzResult:
    """Fuzz `target` (default: reference against fast with `bug`) for `seconds` on `workers`
    processes; see the module docstring. `admission` forces every lockstep case's policy;
    `max_cases` stops each worker after that many cases; `minimize_replays` bounds the
    minimization of a failure by replays as well as by seconds."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if max_cases is not None and max_cases < 1:
        raise ValueError(f"max_cases must be >= 1, got {max_cases}")
    if target is None:
        from kvledger.checker.targets import lockstep_target

        target = lockstep_target(bug)
    workload = workload_for(target, admission)
    workload.prepare()
    recipe = TargetRecipe.of(target)
    expected = workload.expected_events()
    ctx = mp.get_context("spawn")  # fresh interpreters: no inherited torch threads or patches
    messages = ctx.Queue()
    stop = ctx.Event()
    start = time.monotonic()
    records = Path(tempfile.mkdtemp(prefix="kvledger-fuzz-"))  # each worker's record, if it runs cases itself
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                i, recipe, seed, workers, seconds, messages, stop, OP_LIMIT_S, admission, max_cases,
                str(records / f"worker-{i}.jsonl"),
            ),
            daemon=True,
        )
        for i in range(workers)
    ]  # fmt: skip
    for p in procs:
        p.start()
    watch = _Workers(procs, records, target.isolation)
    tally = _Tally()
    failures: List[WorkerFailure] = []
    found_at = None
    fuzz_start: Optional[float] = None  # when the first worker was ready
    last_print = start
    try:
        while not watch.all_stopped() and not (failures and workload.stops_at_first):
            try:
                msg = messages.get(timeout=0.2)
            except queue_mod.Empty:
                msg = None
                failures += watch.deaths(messages.empty())
                if failures and found_at is None:
                    found_at = time.monotonic() - (fuzz_start or start)
            if isinstance(msg, Progress):
                tally.add(msg)
            elif isinstance(msg, Ready):
                fuzz_start = fuzz_start or time.monotonic()
            elif isinstance(msg, (CaseStarted, Done)):
                watch.heard(msg)
            elif isinstance(msg, WorkerFailure):
                failures.append(msg)
                found_at = found_at or time.monotonic() - (fuzz_start or start)
            now = time.monotonic()
            if progress and fuzz_start is not None and now - last_print >= PROGRESS_EVERY:
                log.info(_progress_line(now - fuzz_start, seconds, tally.ops, tally.cases, set(tally.events), expected))
                last_print = now
    finally:
        stop.set()
        _drain_and_join(procs, messages, tally, failures if not workload.stops_at_first else None, watch)
        shutil.rmtree(records, ignore_errors=True)
    elapsed = time.monotonic() - (fuzz_start or start)
    result = FuzzResult(
        tally.ops,
        tally.cases,
        elapsed,
        workers,
        seed,
        target.bug,
        dict(sorted(tally.events.items())),
        seconds_to_find=found_at,
        preemptions=tally.preemptions,
        optimistic_cases=tally.optimistic_cases,
        target=target.name,
        expected=expected,
        hint=workload.replay_hint(),
        stops=watch.stops(),
        first_found=(failures[0].worker, failures[0].case_no) if failures else None,
    )
    kept: Dict[str, WorkerFailure] = {}
    for msg in sorted(failures, key=lambda m: (m.worker, m.case_no)):  # the same choice on any machine
        kept.setdefault(msg.kind, msg)
    for msg in kept.values():
        result.failures.append(
            handle_failure(msg, target, workload, Path(out_dir), seed, minimize_budget, progress, minimize_replays)
        )
    if progress:
        print(format_summary(result))
    return result


class _Tally:
    """The counts of the workers' progress messages, summed."""

    def __init__(self) -> None:
        self.ops = self.cases = self.preemptions = self.optimistic_cases = 0
        self.events: Dict[str, int] = {}

    def add(self, msg: Progress) -> None:
        self.ops += msg.ops
        self.cases += msg.cases
        self.preemptions += msg.preemptions
        self.optimistic_cases += msg.optimistic_cases
        for name, n in msg.events.items():
            self.events[name] = self.events.get(name, 0) + n


def _drain_and_join(
    procs: List[Any], messages: Any, tally: _Tally, failures: Optional[List[WorkerFailure]], watch: _Workers
) -> None:
    # A process that has queued messages exits only once they are read: drain while joining.
    end = time.monotonic() + 10.0
    while (any(p.is_alive() for p in procs) or not messages.empty()) and time.monotonic() < end:
        try:
            msg = messages.get(timeout=0.1)
            if isinstance(msg, Progress):
                tally.add(msg)
            elif isinstance(msg, (CaseStarted, Done)):
                watch.heard(msg)
            elif isinstance(msg, WorkerFailure) and failures is not None:
                failures.append(msg)
        except queue_mod.Empty:
            pass
    for p in procs:
        if p.is_alive():
            p.terminate()
        p.join(timeout=5.0)
    watch.deaths(True, after_stop=True)


@dataclass
class WorkerStop:
    """How one worker ended: the cases it started and why it stopped; `early`: before its budget,
    its cases or the run's end asked it to (its process died, say)."""

    worker: int
    cases: int
    reason: str
    early: bool = False


def _case_on_disk(worker: int, path: Path) -> Optional[CaseStarted]:
    """The case a worker that ran its cases in its own process wrote down before starting it."""
    try:
        case, seed = path.read_text().split()
    except (OSError, ValueError):
        return None
    return CaseStarted(worker, int(case), int(seed))


class _Workers:
    """The parent's watch over its worker processes: the case each one is running, how each ended,
    and a worker that died without a word turned into its finding (from its record, when it ran
    its cases itself) and its stop."""

    def __init__(self, procs: List[Any], records: Path, isolation: Isolation) -> None:
        self.procs, self.records, self.isolation = procs, records, isolation
        self.in_flight: Dict[int, CaseStarted] = {}
        self.ended: Dict[int, WorkerStop] = {}

    def heard(self, msg: Any) -> None:
        if isinstance(msg, CaseStarted):
            self.in_flight[msg.worker] = msg
        elif isinstance(msg, Done):
            self.ended[msg.worker] = WorkerStop(msg.worker, msg.cases, msg.reason)

    def all_stopped(self) -> bool:
        return len(self.ended) == len(self.procs)

    def deaths(self, queue_empty: bool, after_stop: bool = False) -> List[WorkerFailure]:
        """The workers found dead since the last look, as findings (only once their messages are
        all read: a worker that said Done and exited is not dead)."""
        from kvledger.checker import sandbox

        found: List[WorkerFailure] = []
        if not queue_empty:
            return found
        for i, p in enumerate(self.procs):
            if i in self.ended or p.is_alive():
                continue
            case = self.in_flight.get(i) or _case_on_disk(i, self.records / f"worker-{i}.jsonl.case")
            started = case.case + 1 if case is not None else 0
            code = p.exitcode if p.exitcode is not None else -1
            if after_stop and code == -signal.SIGTERM:
                self.ended[i] = WorkerStop(i, started, "stopped by the parent after the run", early=False)
                continue
            died = sandbox.death(code, self.records / f"worker-{i}.jsonl", "", self.isolation)
            reason = f"its process died ({died.kind.partition(':')[2] or died.kind}) in case {started - 1}"
            self.ended[i] = WorkerStop(i, started, reason, early=True)
            if case is not None and died.ops:
                found.append(
                    WorkerFailure(
                        i, case.case, case.seed, asdict(died.header) if died.header else {}, died.ops,
                        died.kind, died.message, len(died.ops), died.detail,
                    )
                )  # fmt: skip
        return found

    def stops(self) -> List[WorkerStop]:
        return [self.ended.get(i, WorkerStop(i, 0, "never reported", early=True)) for i in range(len(self.procs))]


def handle_failure(
    msg: WorkerFailure,
    target: Any,
    workload: Workload,
    out_dir: Path,
    seed: int,
    budget: float,
    progress: bool,
    max_replays: Optional[int] = None,
    paths: Optional[Tuple[Path, Path]] = None,
) -> FuzzFailure:
    """Write a worker's failing trace (with the target's header) and, where the workload
    minimizes its kind, the minimized trace next to it; `paths` (a campaign's names by task)
    replaces the workload's."""
    from kvledger.checker.minimize import MinimizeError

    if is_death(msg.kind) and not target.isolation.enabled:  # its replays must not kill this process
        target = copy.copy(target)
        target.isolation = replace(target.isolation, enabled=True)
        workload = workload_for(target)
    header = Header(**msg.header)
    path, min_path = paths or workload.trace_paths(out_dir, seed, msg.worker, msg.case_no, msg.case_seed, msg.kind)
    trace.write(path, target.trace_header(header, workload.producer), msg.ops)
    failure = FuzzFailure(
        msg.kind, msg.step or len(msg.ops), msg.detail, msg.worker, msg.case_no, path, msg.case_seed,
        traceback=msg.traceback,
    )  # fmt: skip
    if progress:
        log.info(
            "%s in worker %s, case %s, step %s: %s\n  trace: %s (%d ops)",
            msg.kind,
            msg.worker,
            msg.case_no,
            failure.step,
            msg.detail.strip().splitlines()[-1] if msg.detail.strip() else "",
            path,
            len(msg.ops),
        )
    if not workload.minimizes(msg.kind):
        if msg.kind not in ("crash", "hang"):
            failure.detail += " (a property of the run, not of the trace's replay: not minimized)"
        return failure
    try:
        with target.active():
            m_header, m_ops, m_kind = workload.minimize(
                header, msg.ops, msg.kind, budget, max_replays, log.info if progress else None
            )
    except MinimizeError as e:  # the failure did not reproduce in this process
        failure.detail += f" (could not minimize: {e})"
        return failure
    trace.write(min_path, m_header, m_ops)
    failure.minimized_path, failure.minimized_ops, failure.minimized_kind = min_path, len(m_ops), m_kind
    with target.active():
        again, _ = replay_isolated(target, m_header, m_ops)
    failure.minimized_traceback = again.detail if again is not None else ""
    return failure


def format_summary(result: FuzzResult) -> str:
    lines = [
        f"{result.target}: {result.ops:,} operations in {result.cases:,} cases, {result.seconds:.1f}s on "
        f"{result.workers} worker(s) (seed {result.seed}): {result.ops_per_s:,.0f} ops/s"
    ]
    if result.optimistic_cases or result.preemptions:
        lines.append(
            f"optimistic admission: {result.optimistic_cases:,} complete cases, "
            f"{result.preemptions:,} requests preempted"
        )
    reached, expected = set(result.events), result.expected
    if expected:
        lines.append(f"rare events reached ({len(reached & expected)}/{len(expected)}):")
        lines += [f"  [{'x' if name in reached else ' '}] {name}" for name in sorted(expected)]
    others = sorted(reached - expected)
    if others:
        lines.append(("other events: " if expected else "events reached: ") + ", ".join(others))
    lines += [
        f"worker {w.worker}: {w.cases:,} case(s), {'ENDED EARLY: ' if w.early else ''}{w.reason}" for w in result.stops
    ]
    if not result.failures:
        if result.incomplete:
            lines.append("INCOMPLETE: no finding in the cases that ran, but a worker ended early (above)")
        else:
            lines.append("no finding")
    elif result.first_found is not None and result.seconds_to_find is not None:
        worker, case = result.first_found
        lines.append(f"first finding to arrive: after {result.seconds_to_find:.1f}s, worker {worker}, case {case}")
    for f in result.failures:
        if f.kind == "crash":
            lines.append(f"CRASH in worker {f.worker}, case {f.case} (not a finding):\n{f.detail}")
            lines.append(f"trace up to the crash: {f.trace_path}")
        elif f.kind == "hang":
            lines.append(f"HANG in worker {f.worker}, case {f.case}: {f.detail}")
            lines.append(f"trace up to and including that operation: {f.trace_path} (not minimized)")
        else:
            lines.append(f"FOUND {f.kind} at step {f.step} (worker {f.worker}, case {f.case}): {f.detail}")
            lines.append(f"failing trace: {f.trace_path}")
            if f.minimized_path is not None:
                lines.append(f"minimized ({f.minimized_ops} ops, {f.minimized_kind}): {f.minimized_path}")
            lines.append(f"replay it: kvledger replay {f.minimized_path or f.trace_path}")
            if result.hint:
                lines.append(result.hint)
            shown = f.minimized_traceback if f.minimized_path is not None else f.traceback
            if shown.strip():
                whose = "the minimized trace's" if f.minimized_path is not None else "the failing run's"
                lines.append(f"{whose} traceback:\n{shown.rstrip()}")
    return "\n".join(lines)
