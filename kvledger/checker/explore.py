"""`kvledger explore`: breadth-first exploration of every state of a small scope, each visited once.

The fuzzer and the Hypothesis run sample operation sequences; this enumerates them. From the empty
state it applies every operation the scope's alphabet allows (`explore_scope.py`), generated from
the state itself in a fixed order: submit each prompt with each max_tokens (while fewer than
`max_live` requests are in the system), prefill with each budget and each sample, decode with each
sample, finish each running request, abort each waiting then each running one, evict each size
(clipped to what is evictable), probe each prompt, and, with `idle`, a prefill or decode that has
nothing to do. An operation the model refuses (InvalidOp) is not a transition.

Each state reached gets a key (`explore_state.py`: uids and pages renamed to a normal form, the
whole state of reference and fast, hashed); a state whose key was seen is not expanded again, so
the search visits each distinct state once, as TLC does. Every transition is checked the way the
lockstep harness checks one step: the operation's result on both sides, the invariants on both,
the full snapshots. The search is breadth-first, so the first divergence found of each kind is a
shortest trace to it (merging a state into an equivalent one seen earlier never lengthens a path:
the one kept was reached in as few operations or fewer). A divergence is written as an ordinary
trace (`trace.write`, producer "kvledger explore") that `kvledger replay` and `kvledger show` read.

Two ways to reach a successor: `copy` (deepcopy the parent's Lockstep, apply one operation: the
`Lockstep.copy`) and `replay` (a fresh Lockstep, the whole path replayed from the empty state:
what any subject supports). Subjects (`--subject SPEC`) are driven through the SubjectDriver in
judge mode (the judge after every operation); their key is the driver's bookkeeping and the
subject's View, see `explore_state.subject_key`. A subject's crash is a finding with a trace.

The search stops when the frontier is empty (the scope is *exhausted*), at `max_depth` or
`max_states` (cut), at the first finding (unless all kinds are collected), on Ctrl-C or SIGTERM
(the command turns it into Ctrl-C), or past a `seconds` safety cap: a cut run's report is marked
partial, with the states explored and the depth reached. Apart from that cap, decisions never read
the clock: it feeds states/s and, without a progress bar, a progress line on stderr every
PROGRESS_EVERY_S seconds. A scope in which no request can be admitted is explored (and exhausted)
all the same, with a warning in the report.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from array import array
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

from kvledger.checker import sandbox
from kvledger.checker.explore_scope import Scope
from kvledger.checker.explore_state import StateKey, lockstep_key, subject_key
from kvledger.engine.ledger import trace
from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import (
    Abort,
    Decode,
    Evict,
    Finish,
    InvalidOp,
    OpRecord,
    OpResult,
    Prefill,
    Probe,
    Submit,
    written,
)
from kvledger.engine.ledger.trace import Header
from kvledger.properties.lockstep import Lockstep
from kvledger.properties.target import LockstepTarget, SubjectRun, SubjectTarget

log = logging.getLogger(__name__)
PATHS = ("copy", "replay")
PROGRESS_EVERY_S = 10.0
Op = OpRecord  # a successor's operation, as the counterexample's trace writes it


Outcome = Union[Any, Finding]  # a successor state, or what went wrong


@dataclass
class Counterexample:
    """The shortest counterexample of one kind: its operations (the last one fails)."""

    kind: str
    message: str
    depth: int
    ops: List[Op]
    trace_path: Optional[Path] = None


@dataclass
class ExploreResult:
    scope: Scope
    mode: str  # "lockstep" or "subject <spec>"
    path: str  # "copy" or "replay"
    canonical: bool
    merge: bool
    bug: Optional[str] = None
    states: int = 0  # distinct states stored (the empty state included)
    transitions: int = 0  # operations applied that the model accepted
    depth: int = 0  # the deepest state stored
    exhausted: bool = False  # the frontier ran empty: every reachable state was visited
    cut: Optional[str] = None  # why it stopped early: "depth", "states", "finding", "interrupted", "seconds"
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    start_rss_mb: float = 0.0
    keys: int = 0
    per_depth: List[int] = field(default_factory=list)  # new states at each depth
    findings: List[Counterexample] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)  # what makes the result mean less than it says

    @property
    def partial(self) -> bool:
        """Cut short of the scope by a limit or a signal (a finding's cut is the search's answer)."""
        return self.cut is not None and self.cut != "finding"

    @property
    def states_per_s(self) -> float:
        return self.states / self.seconds if self.seconds > 0 else 0.0

    @property
    def transitions_per_s(self) -> float:
        return self.transitions / self.seconds if self.seconds > 0 else 0.0

    @property
    def kinds(self) -> Dict[str, int]:
        """Each divergence kind found -> the length of its shortest counterexample."""
        return {f.kind: f.depth for f in self.findings}

    @property
    def exit_code(self) -> int:
        return 1 if self.findings else 0


# -- the operations enabled at a state ------------------------------------------------------------
def _submits(scope: Scope, next_uid: int) -> List[Op]:
    return [
        written(Submit(next_uid, tuple(p), m))
        for p in scope.prompts
        for m in scope.max_tokens
        if len(p) + m <= scope.max_seq_len
    ]


def _steps(scope: Scope, waiting: bool, running: bool) -> List[Op]:
    ops: List[Op] = []
    idle = "idle" in scope.ops
    if "prefill" in scope.ops:
        if waiting:
            ops += [written(Prefill(b, tuple(s))) for b in scope.budgets for s in scope.samples]
        elif idle:
            ops.append(written(Prefill(scope.budgets[0])))
    if "decode" in scope.ops:
        if running:
            accepts = scope.accepts if scope.spec_tokens else ((),)
            ops += [written(Decode(tuple(s), accept=tuple(a))) for s in scope.samples for a in accepts]
        elif idle:
            ops.append(written(Decode()))
    return ops


def _evicts(scope: Scope, evictable: int) -> List[Op]:
    if "evict" not in scope.ops or evictable <= 0:
        return []
    sizes = {min(n, evictable) for n in scope.evicts} | ({evictable} if scope.evict_all else set())
    return [written(Evict(n)) for n in sorted(sizes) if n > 0]


def lockstep_ops(scope: Scope, lock: Lockstep) -> List[Op]:
    """The operations to try at `lock`'s state, in the fixed order of the module docstring."""
    ref = lock.ref
    waiting = [p.uid for p in ref.waiting]
    running = ref.dm.running_reqs.uids()
    in_system = len(set(waiting) | set(ref.live))
    ops: List[Op] = []
    if "submit" in scope.ops and in_system < scope.max_live:
        ops += _submits(scope, ref.next_uid())
    ops += _steps(scope, bool(waiting), bool(running))
    if "finish" in scope.ops:
        ops += [written(Finish(u)) for u in running]
    if "abort" in scope.ops:
        ops += [written(Abort(u)) for u in waiting + [u for u in running if u not in waiting]]
    ops += _evicts(scope, ref.cm.prefix_cache.size_info.evictable_size)
    if "probe" in scope.ops:
        ops += [written(Probe(tuple(p))) for p in scope.probe_prompts]
    return ops


# -- backends: how states are built and stepped -----------------------------------------------------
class LockstepBackend:
    """Reference against fast (a LockstepTarget's runs are Lockstep harnesses); `copy` or `replay`
    successors."""

    def __init__(
        self, scope: Scope, path: str = "copy", canonical: bool = True, target: Optional[LockstepTarget] = None
    ) -> None:
        if path not in PATHS:
            raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
        self.scope, self.path, self.canonical = scope, path, canonical
        self.target = target or LockstepTarget()
        self.header = scope.header()
        self.keeps_states = path == "copy"

    def root(self) -> Lockstep:
        return self.target.start(self.header)

    def rebuild(self, ops: Sequence[Op]) -> Lockstep:
        lock = self.root()
        for op in ops:
            lock.apply(op)
        return lock

    def key(self, lock: Lockstep) -> StateKey:
        return lockstep_key(lock, self.canonical)

    def ops(self, lock: Lockstep) -> List[Op]:
        return lockstep_ops(self.scope, lock)

    def successors(
        self, lock: Lockstep, path: Sequence[Op], consume: bool = False
    ) -> Iterator[Tuple[Op, Optional[Outcome]]]:
        """(op, successor or Finding) for each op enabled at `lock`; None for an op refused as invalid.
        consume: the caller is done with `lock`, so the last operation is applied to it, not to a
        copy (on the copy path a state has about two successors: this saves a third of the copies,
        which are most of the search's time)."""
        spare: Optional[Lockstep] = None
        ops = self.ops(lock)
        for i, op in enumerate(ops):
            if self.path == "copy":
                last = consume and i == len(ops) - 1
                child = spare if spare is not None else lock if last else lock.copy()
            else:
                child = self.rebuild(path)
            spare = None
            try:
                child.apply(op)
            except InvalidOp:
                child.step = len(child.ops)  # a refused op changes nothing: the copy is reused
                spare = child if self.path == "copy" else None
                yield op, None
                continue
            except Finding as e:
                yield op, e
                continue
            yield op, child

    def header_for_trace(self) -> Header:
        return self.target.trace_header(self.header, "kvledger explore")


class SubjectBackend:
    """One subject in judge mode (a SubjectTarget's runs drive it through the SubjectDriver).
    `replay` builds each state from a fresh subject; `copy` deepcopies the run (and the subject in
    it) where that works."""

    def __init__(self, scope: Scope, target: SubjectTarget, path: str = "replay") -> None:
        if path not in PATHS:
            raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
        self.scope, self.path, self.canonical = scope, path, True
        self.target = target
        self.header = scope.header()
        self.keeps_states = path == "copy"

    def root(self) -> SubjectRun:
        run = self.target.start(self.header)
        if self.path == "copy":
            try:
                run.copy()
            except Exception as e:  # not every subject can be copied: replay it from the start
                log.warning("%s cannot be deep-copied (%s): replaying each state from the start", self.target.name, e)
                self.path, self.keeps_states = "replay", False
        return run

    def rebuild(self, ops: Sequence[Op]) -> SubjectRun:
        run = self.target.start(self.header)
        for op in ops:
            run.apply(op)
        return run

    def key(self, run: SubjectRun) -> StateKey:
        return subject_key(run.driver, self.canonical)

    def ops(self, run: SubjectRun) -> List[Op]:
        scope, driver = self.scope, run.driver
        in_system = len(set(driver.waiting) | set(driver.live))
        ops: List[Op] = []
        if "submit" in scope.ops and in_system < scope.max_live:
            ops += _submits(scope, max(driver.known, default=-1) + 1)
        running = list(driver.running)
        ops += _steps(scope, bool(driver.waiting), bool(running))
        if "finish" in scope.ops:
            ops += [written(Finish(u)) for u in running]
        if "abort" in scope.ops:
            ops += [written(Abort(u)) for u in list(driver.waiting) + [u for u in running]]
        if driver.caps.explicit_evict:
            view = driver.view()
            ops += _evicts(scope, view.counters.get("evictable_tokens", max(scope.evicts, default=0)))
        return ops

    def successors(
        self, run: SubjectRun, path: Sequence[Op], consume: bool = False
    ) -> Iterator[Tuple[Op, Optional[Outcome]]]:
        """As LockstepBackend.successors (a subject's run is always copied or rebuilt)."""
        for op in self.ops(run):
            try:
                child = run.copy() if self.path == "copy" else self.rebuild(path)
                child.apply(op)
            except InvalidOp:
                yield op, None
                continue
            except Finding as f:
                yield op, f
                continue
            yield op, child

    def header_for_trace(self) -> Header:
        return self.target.trace_header(self.header, "kvledger explore")


# -- the search -------------------------------------------------------------------------------------
def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return 0.0


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _bar(enabled: Optional[bool], desc: str) -> Any:
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(desc=desc, unit="state", file=sys.stderr)


class _Lines:
    """Progress without a terminal (a CI log, a file): a line on stderr every PROGRESS_EVERY_S seconds."""

    def __init__(self, desc: str) -> None:
        self.desc, self.start = desc, time.perf_counter()
        self.last = self.start

    def tick(self, depth: int, states: int, frontier: int) -> None:
        now = time.perf_counter()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            print(
                f"{self.desc}: {states:,} states, depth {depth}, frontier {frontier:,}, {now - self.start:.0f}s",
                file=sys.stderr,
                flush=True,
            )


class _Tree:
    """Every stored state as (parent, operation): a state's path is read back by walking up."""

    def __init__(self) -> None:
        self.parent = array("l", [-1])
        self.op = array("l", [-1])
        self.ops: List[Op] = []
        self._op_ids: Dict[Op, int] = {}

    def add(self, parent: int, op: Op) -> int:
        oid = self._op_ids.get(op)
        if oid is None:
            oid = self._op_ids[op] = len(self.ops)
            self.ops.append(op)
        self.parent.append(parent)
        self.op.append(oid)
        return len(self.parent) - 1

    def path(self, node: int) -> List[Op]:
        out = []
        while node > 0:
            out.append(self.ops[self.op[node]])
            node = self.parent[node]
        return out[::-1]

    def __len__(self) -> int:
        return len(self.parent)


def search(
    backend: Any,
    scope: Scope,
    result: ExploreResult,
    *,
    merge: bool = True,
    all_kinds: bool = False,
    progress: Optional[bool] = None,
    max_kept: int = 200_000,
    seconds: Optional[float] = None,
) -> ExploreResult:
    """Breadth-first search with `backend` (LockstepBackend or SubjectBackend), filling `result`.
    `all_kinds`: go on after a finding, collecting the shortest counterexample of every kind.
    `max_kept`: states kept as objects on the frontier (copy path); the rest are rebuilt by replay.
    `progress`: a tqdm bar (None: when stderr is a terminal, else progress lines; False: neither).
    `seconds`: a safety cap on wall time (a cut "seconds": the report is partial)."""
    start = time.perf_counter()
    result.start_rss_mb = _rss_mb()
    seen: Set[StateKey] = set()
    tree = _Tree()
    found: Dict[str, Counterexample] = {}
    bar = _bar(progress, f"explore {scope.name}")
    lines = _Lines(f"explore {scope.name}") if bar is None and progress is None else None
    stop: Optional[str] = None
    frontier: List[Tuple[int, Any]] = []
    depth = 0
    try:
        try:
            root = backend.root()
        except AssertionError as e:  # a subject that fails as it is built: a finding at depth 0
            found[getattr(e, "kind", "subject-raised")] = Counterexample(
                getattr(e, "kind", "subject-raised"), getattr(e, "message", str(e)), 0, []
            )
            root, stop = None, "finding"
        if root is not None:
            if merge:
                seen.add(backend.key(root))
            frontier = [(0, root)]
            result.per_depth.append(1)
        while frontier and stop is None:
            if scope.max_depth is not None and depth >= scope.max_depth:
                stop = "depth"
                break
            nxt: List[Tuple[int, Any]] = []
            kept = 0
            for node, state in frontier:
                path = tree.path(node)
                if state is None:
                    state = backend.rebuild(path)
                for op, outcome in backend.successors(state, path, consume=True):
                    if outcome is None:
                        continue
                    result.transitions += 1
                    if isinstance(outcome, Finding):
                        if outcome.kind not in found:
                            found[outcome.kind] = Counterexample(outcome.kind, outcome.message, depth + 1, path + [op])
                            log.info("found %s in %d operations", outcome.kind, depth + 1)
                        if not all_kinds:
                            stop = "finding"
                            break
                        continue
                    if merge:
                        try:
                            key = backend.key(outcome)
                        except Exception as e:  # a state too broken to read: a finding of its own
                            kind = f"key-raised:{type(e).__name__}"
                            found.setdefault(kind, Counterexample(kind, str(e), depth + 1, path + [op]))
                            if not all_kinds:
                                stop = "finding"
                                break
                            continue
                        if key in seen:
                            continue
                        seen.add(key)
                    child = tree.add(node, op)
                    keep = backend.keeps_states and kept < max_kept
                    kept += keep
                    nxt.append((child, outcome if keep else None))
                    if scope.max_states is not None and len(tree) >= scope.max_states:
                        stop = "states"
                        break
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(depth=depth, states=len(tree), frontier=len(nxt), refresh=False)
                elif lines is not None:
                    lines.tick(depth, len(tree), len(nxt))
                if stop is None and seconds is not None and time.perf_counter() - start >= seconds:
                    stop = "seconds"
                if stop is not None:
                    break
            if nxt:
                result.per_depth.append(len(nxt))
                result.depth = depth + 1
            frontier = nxt
            depth += 1
    except KeyboardInterrupt:
        stop = "interrupted"
        log.warning("interrupted at depth %d: reporting what was explored", depth)
    finally:
        if bar is not None:
            bar.close()
    result.states = len(tree) if result.per_depth else 0
    result.keys = len(seen)
    result.exhausted = stop is None and not frontier
    if stop == "finding" and all_kinds:
        stop = None
    result.cut = stop
    result.findings = sorted(found.values(), key=lambda f: (f.depth, f.kind))
    result.seconds = time.perf_counter() - start
    result.peak_rss_mb = _peak_rss_mb()
    return result


def explore(
    scope: Scope,
    *,
    target: Optional[Union[LockstepTarget, SubjectTarget]] = None,
    bug: Optional[str] = None,
    subject: Optional[str] = None,
    edits: Sequence[Any] = (),
    path: str = "copy",
    canonical: bool = True,
    merge: bool = True,
    all_kinds: bool = False,
    out_dir: Optional[Union[str, Path]] = None,
    progress: Optional[bool] = None,
    seconds: Optional[float] = None,
) -> ExploreResult:
    """Explore `scope` (see the module docstring) on `target`, or on the one `bug` (a zoo bug of
    fast) or `subject` (a spec, with `edits`) names. Counterexamples are written under `out_dir`
    when it is given, named after the bug (`clean` without one)."""
    from kvledger.checker.targets import lockstep_target, subject_target

    if target is None:
        target = subject_target(subject, edits=edits) if subject is not None else lockstep_target(bug)
    backend: Union[LockstepBackend, SubjectBackend]
    if isinstance(target, SubjectTarget):
        backend = SubjectBackend(scope, target, path)
        mode = f"subject {target.name}"
    else:
        backend = LockstepBackend(scope, path, canonical, target)
        mode = "lockstep"
    result = ExploreResult(scope, mode, path, canonical, merge, target.bug)
    never = scope.never_admits()
    if never is not None:
        result.warnings.append(never)
        log.warning("scope %s: %s", scope.name, never)
    with target.active():
        try:
            result, result.path = sandbox.call(
                target.isolation, _search, backend, scope, result, merge, all_kinds, progress, seconds
            )
        except sandbox.SubjectDied as died:  # the search's counts died with it; its path did not
            result.cut = "finding"
            result.findings.append(Counterexample(died.kind, died.message, len(died.ops), list(died.ops)))
            result.warnings.append(
                f"the search's process died ({died.kind}) and its counts with it (they read 0); "
                "the counterexample is the path the search took to the dying state"
            )
    if out_dir is not None:
        write_findings(result, backend.header_for_trace(), Path(out_dir))
    return result


def _search(
    backend: Union[LockstepBackend, SubjectBackend],
    scope: Scope,
    result: ExploreResult,
    merge: bool,
    all_kinds: bool,
    progress: Optional[bool],
    seconds: Optional[float],
) -> Tuple[ExploreResult, str]:
    """`search` as the sandbox's child runs it: the result it filled in and the path it took."""
    search(backend, scope, result, merge=merge, all_kinds=all_kinds, progress=progress, seconds=seconds)
    return result, backend.path


def write_findings(result: ExploreResult, header: Header, out_dir: Path) -> None:
    for f in result.findings:
        name = f"explore-{result.scope.name}-{result.bug or 'clean'}-{_slug(f.kind)}.jsonl"
        f.trace_path = out_dir / name
        trace.write(f.trace_path, header, f.ops)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in text).strip("-")


def format_result(result: ExploreResult) -> str:
    """The report `kvledger explore` prints on stdout."""
    r = result
    status = "exhausted" if r.exhausted else f"cut ({r.cut})"
    if r.partial:
        status += f": PARTIAL, not exhausted ({r.states:,} states explored, depth {r.depth} reached)"
    lines = [
        f"scope {r.scope.name}: {r.mode}, {r.path} path, "
        + ("canonical keys" if r.canonical else "plain keys")
        + ("" if r.merge else ", no merging")
        + (f", bug {r.bug}" if r.bug else ""),
        r.scope.describe(),
        f"states {r.states:,}  transitions {r.transitions:,}  depth {r.depth}  {status}",
        f"time {r.seconds:.1f}s  {r.states_per_s:,.0f} states/s  {r.transitions_per_s:,.0f} transitions/s",
        f"memory: peak RSS {r.peak_rss_mb:,.0f} MiB (at start {r.start_rss_mb:,.0f} MiB), {r.keys:,} keys stored "
        f"({r.keys * 16 / 2**20:.1f} MiB of digests)",
        "new states per depth: " + " ".join(map(str, r.per_depth)),
    ]
    lines.extend(f"WARNING: {w}" for w in r.warnings)
    if not r.findings:
        lines.append("no divergence" + (" in the whole scope" if r.exhausted else " up to the cut"))
    for f in r.findings:
        lines.append(f"DIVERGENCE {f.kind}: shortest counterexample {f.depth} operations: {f.message[:300]}")
        for op in f.ops:
            lines.append(f"    {op.to_json()}")
        if f.trace_path is not None:
            extra = f" --bug {r.bug}" if r.bug else ""
            lines.append(f"  trace: {f.trace_path}\n  replay it: kvledger replay {f.trace_path}{extra}")
    return "\n".join(lines)


def parse_prompts(text: str) -> Tuple[Tuple[int, ...], ...]:
    """`0,0,1;1,0` -> ((0, 0, 1), (1, 0)) (the CLI's --prompts)."""
    return tuple(tuple(int(t) for t in part.split(",") if t.strip()) for part in text.split(";") if part.strip())


def parse_ints(text: str) -> Tuple[int, ...]:
    return tuple(int(t) for t in text.split(",") if t.strip())


ProgressFn = Callable[[str], None]


# -- auditing the canonicalization --------------------------------------------------------------------
def _renamed(result: OpResult, uids: Dict[int, Any], locs: Callable[[Sequence[int]], Tuple[Any, ...]]) -> Any:
    """An operation's result with its uids and KV locations renamed (see `audit_merges`)."""
    out = {}
    produced = {f.name: getattr(result, f.name) for f in fields(result)}
    for k, v in sorted(produced.items()):
        if v is None:
            continue  # a field the operation did not produce
        if k in ("batch", "preempted"):
            out[k] = tuple(uids.get(u, ("uid", u)) for u in v)
        elif k == "refused":
            out[k] = uids.get(v, ("uid", v))
        elif k in ("evicted", "indices"):
            out[k] = locs(v)
        else:
            out[k] = v
    return tuple(out.items())


def observe(scope: Scope, lock: Lockstep, lookahead: int) -> Tuple[Any, ...]:
    """What every operation sequence of up to `lookahead` operations from `lock` shows, uids and
    pages renamed: for each enabled operation in order, refused, the divergence kind, or the result
    and what follows. Two states that canonicalization merges must observe alike."""
    from kvledger.checker.explore_state import _Names

    names = _Names(lock.ref, True)
    out: List[Tuple[Any, ...]] = []
    for op in lockstep_ops(scope, lock):
        child = lock.copy()
        try:
            result = child.apply(op)
        except InvalidOp:
            out.append(("invalid",))
            continue
        except Finding as e:
            out.append(("diverged", e.kind))
            continue
        uids = dict(names.uid)
        if isinstance(op.op, Submit):
            uids[op.op.uid] = len(uids)
        after = _Names(child.ref, True)
        rest = observe(scope, child, lookahead - 1) if lookahead > 1 else ()
        out.append(("ok", op.name, _renamed(result, uids, after.locs), rest))
    return tuple(out)


@dataclass
class AuditResult:
    merges: int = 0  # merged pairs audited
    mismatches: List[Tuple[List[Op], List[Op]]] = field(default_factory=list)  # (kept path, merged path)


def audit_merges(scope: Scope, *, bug: Optional[str] = None, lookahead: int = 2, max_merges: int = 100) -> AuditResult:
    """Breadth-first search as `explore` does it, but each time a successor's key was seen, check
    that it and the state kept for that key observe alike up to `lookahead` operations (`observe`).
    The first `max_merges` merges are audited; a mismatch is a canonicalization that merged two
    states the lockstep harness tells apart."""
    from kvledger.checker.targets import lockstep_target

    audit = AuditResult()
    backend = LockstepBackend(scope, "copy", canonical=True, target=lockstep_target(bug))
    with backend.target.active():
        root = backend.root()
        kept: Dict[StateKey, Tuple[Lockstep, List[Op]]] = {backend.key(root): (root, [])}
        frontier: List[Tuple[Lockstep, List[Op]]] = [(root, [])]
        depth = 0
        while frontier and audit.merges < max_merges and (scope.max_depth is None or depth < scope.max_depth):
            nxt = []
            for lock, path in frontier:
                for op, outcome in backend.successors(lock, path):
                    if outcome is None or isinstance(outcome, Finding):
                        continue
                    key = backend.key(outcome)
                    if key not in kept:
                        kept[key] = (outcome, path + [op])
                        nxt.append((outcome, path + [op]))
                        continue
                    if audit.merges >= max_merges:
                        continue
                    audit.merges += 1
                    first, first_path = kept[key]
                    if observe(scope, first, lookahead) != observe(scope, outcome, lookahead):
                        audit.mismatches.append((first_path, path + [op]))
            frontier = nxt
            depth += 1
    return audit
