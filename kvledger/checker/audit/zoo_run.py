"""`kvledger zoo`: which of the checker's runs catches each planted bug of a target's zoo, after
how many sequences or cases, and how small its failing trace gets.

The zoo is the target's: fast's planted bugs (`subjects/fast_zoo.py`) for reference against fast
(and for `--subject fast`), a subject adapter's `ZOO` of source edits for any other subject
(`zoo_targets`: a target per bug). Every decision is by counts, never by time, so the table is
the same on an idle laptop and on a loaded CI machine. For each bug:
  hypothesis  (lockstep only) the CI profile of the lockstep state machine (derandomized, without
              shrinking) with the bug patched in, in a child process, for its first `sequences`
              sequences; caught = a sequence within them failed; the count is that sequence's
              number (1 = the first).
  fuzz        the fuzzer's cases (`checker/fuzz.py`, the target's workload), seed 0, worker 0 of
              1, its first `cases` cases in this process; the count is the case that failed
              (1 = the first).
  min ops     the length of the minimized failing trace: the fuzzer's, else the Hypothesis
              failing trace run through `checker/minimize.py` (both bounded by replays).
The seconds caps (`--hypothesis-seconds`, `--fuzz-seconds`) are a safety net for a run that hangs:
a run stopped by one decides nothing and is reported as `cap`, an error of the zoo run, not an
escape (raise the cap, or run the bug alone).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kvledger.checker.minimize import MinimizeError, minimize
from kvledger.checker.targets import SpecTarget, lockstep_target, subject_target
from kvledger.engine.ledger import trace
from kvledger.properties.target import LockstepTarget
from kvledger.subjects.fast_zoo import BUGS, SPECULATION_BUGS, patched

_log = logging.getLogger(__name__)  # `log` is run_zoo's callback

HYPOTHESIS_SEQUENCES = 150  # the CI profile's first sequences (of 1500): a few seconds' worth
HYPOTHESIS_CAP_S = 600.0  # safety nets only: a run stopped by one decides nothing
FUZZ_CAP_S = 300.0
MINIMIZE_BUDGET_S = 60.0
MINIMIZE_REPLAYS = 2000  # what bounds the minimizer in practice: the same trace on any machine
_FIRST_CATCH = "first-catch.json"


@dataclass
class ZooRow:
    bug: str
    origin: str
    hyp_caught: Optional[bool] = False  # None: not run (a subject's zoo: the fuzzer alone)
    hyp_sequences: Optional[int] = None  # the sequence that failed first, or the sequences run
    hyp_seconds: Optional[float] = None  # to the first failure (reported, never decides)
    hyp_kind: str = ""
    hyp_capped: bool = False  # stopped by the safety cap before its sequences were run: undecided
    fuzz_caught: Optional[bool] = None  # None: not run (--fuzz-cases 0)
    fuzz_cases: Optional[int] = None  # the case that diverged, or the cases run
    fuzz_seconds: Optional[float] = None
    fuzz_kind: str = ""
    fuzz_capped: bool = False
    min_ops: Optional[int] = None
    min_trace: Optional[str] = None

    @property
    def escaped(self) -> bool:
        return not self.hyp_caught and not self.fuzz_caught and not self.undecided

    @property
    def undecided(self) -> bool:
        """Missed by both, but a run was cut by its seconds cap: the counts were not all run."""
        return not self.hyp_caught and not self.fuzz_caught and (self.hyp_capped or self.fuzz_capped)


# -- Hypothesis, in a child process ------------------------------------------------------------


def _hypothesis_child(name: str, out: Path, sequences: int) -> int:
    """Run the CI profile with `name` patched in, for at most `sequences` sequences; record the
    first catch (its sequence number) in `out` at once (the parent may kill us at its cap)."""
    from hypothesis import Phase, settings

    from kvledger.properties.machine import LockstepMachine, Progress, run_machine
    from kvledger.properties.profiles import register_profiles

    if name in SPECULATION_BUGS:  # a bug of fast's speculation: the speculating run (a LockstepMachine too)
        from kvledger.properties.speculation_machine import run_machine

    start = time.perf_counter()
    first: Dict[str, Any] = {}
    progress = Progress()

    def spent() -> None:
        """The budget is spent without a catch: record that and stop here, at once."""
        result = {"caught": False, "sequences": sequences, "total_seconds": time.perf_counter() - start}
        (out / "result.json").write_text(json.dumps(result))
        os._exit(0)

    def caught(e: BaseException) -> None:
        if progress.sequences > sequences and not first:
            spent()
        if not first:
            first.update(
                sequence=progress.sequences,
                seconds=time.perf_counter() - start,
                kind=getattr(e, "kind", type(e).__name__),
            )
            (out / _FIRST_CATCH).write_text(json.dumps(first))

    # Both ways a sequence fails (an operation's divergence, a property of the run) are wrapped in
    # place: a subclass would change the test's identity and with it the derandomized examples, so
    # it would not be the CI run.
    do, check = LockstepMachine._do, LockstepMachine._check

    def counted_do(self: LockstepMachine, op: Dict[str, Any]) -> Any:
        if progress.sequences > sequences and not first:
            spent()
        try:
            return do(self, op)
        except Exception as e:
            caught(e)
            raise

    def counted_check(self: LockstepMachine, ok: bool, message: str) -> None:
        try:
            check(self, ok, message)
        except AssertionError as e:
            caught(e)
            raise

    LockstepMachine._do = counted_do  # type: ignore[method-assign,assignment]  # this child process only
    LockstepMachine._check = counted_check  # type: ignore[method-assign,assignment]
    register_profiles("ci")
    # No shrinking: Hypothesis stops at the first failing sequence, which minimize.py shrinks
    # (far faster than Hypothesis shrinking a stateful run).
    default = settings.default
    assert default is not None  # register_profiles loaded the ci profile
    phases = [p for p in default.phases if p is not Phase.shrink]
    with patched(name):
        try:
            run_machine(settings(default, phases=phases), progress)
        except Exception as e:  # caught: Hypothesis re-raises the failure
            caught(e)
            result = {**first, "caught": True, "total_seconds": time.perf_counter() - start}
        else:
            result = {"caught": False, "sequences": progress.sequences, "total_seconds": time.perf_counter() - start}
    (out / "result.json").write_text(json.dumps(result))
    return 0


def run_hypothesis(
    name: str, work: Path, sequences: int = HYPOTHESIS_SEQUENCES, cap_s: float = HYPOTHESIS_CAP_S
) -> Dict[str, Any]:
    """The CI profile's first `sequences` sequences against bug `name` (`cap_s`: a safety net).
    Returns caught, sequence (the first that failed) or sequences (run), seconds, kind, timed_out
    and, if caught, the failing trace's path."""
    work.mkdir(parents=True, exist_ok=True)
    for stale in ("result.json", _FIRST_CATCH):
        (work / stale).unlink(missing_ok=True)
    env = {**os.environ, "KVLEDGER_FAILURES": str(work), "HYPOTHESIS_PROFILE": "ci"}
    cmd = [
        sys.executable,
        "-m",
        "kvledger.checker.audit.zoo_run",
        "--hypothesis-child",
        name,
        str(work),
        str(sequences),
    ]
    timed_out, stderr = False, ""
    try:
        proc = subprocess.run(
            cmd,
            env=env,
            timeout=cap_s,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[3],
            check=False,
        )
        stderr = proc.stderr
    except subprocess.TimeoutExpired:  # subprocess.run kills the child
        timed_out = True
    if (work / _FIRST_CATCH).exists():  # the first catch decides, whatever came after it
        result = {**json.loads((work / _FIRST_CATCH).read_text()), "caught": True}
    elif (work / "result.json").exists():
        result = json.loads((work / "result.json").read_text())
    elif timed_out:
        result = {"caught": False}
    else:
        raise RuntimeError(f"the Hypothesis run for {name} failed to start:\n{stderr[-2000:]}")
    result["timed_out"] = timed_out
    failing = work / "hypothesis-last-failure.jsonl"
    if result["caught"] and failing.exists():
        result["trace"] = str(failing)
    return result


# -- the zoo's targets, the fuzzer and the minimizer ---------------------------------------------
class _FastWithBug(SpecTarget):
    """`--subject fast` with one of fast's planted bugs: the subject target, the bug patched into
    fast's classes while it is active (fast's zoo is patches, not source edits)."""

    def active(self) -> Any:
        return patched(self.bug)


def zoo_targets(target: Any) -> List[Tuple[str, str, Any]]:
    """(bug, where it comes from, a target with it) for each bug of `target`'s zoo."""
    if isinstance(target, LockstepTarget):
        return [(name, bug.origin, lockstep_target(name, target.device)) for name, bug in BUGS.items()]
    if not isinstance(target, SpecTarget):
        raise ValueError(f"{target.name} names no zoo (build the target from a subject spec)")
    spec = target.spec
    if spec.name == "fast":
        return [(name, BUGS[name].description, _FastWithBug(spec, (), None, name)) for name in sorted(BUGS)]
    base = spec.zoo_base()
    return [(e.name, e.why, subject_target(spec.text, bug=e.name, edits=base + (e,))) for e in spec.zoo()]


def run_fuzz(target: Any, cases: int, work: Path, cap_s: float = FUZZ_CAP_S) -> Dict[str, Any]:
    """The fuzzer's first `cases` cases on `target` (seed 0, worker 0 of 1, in this process;
    `cap_s`: a safety net); the first finding is written and minimized under `work` (within the
    workload's `zoo_minimize` budget)."""
    from kvledger.checker.fuzz import WorkerFailure, handle_failure
    from kvledger.checker.fuzz_case import play_case
    from kvledger.checker.workloads import workload_for
    from kvledger.reference import events

    workload = workload_for(target)
    workload.prepare()
    start = time.monotonic()
    try:
        with target.active():
            for k in range(cases):
                outcome = play_case(workload, k, workload.case_seed(0, 0, 1, k))
                f = outcome.finding
                if f is not None:
                    seconds = time.monotonic() - start
                    failure = WorkerFailure(
                        0, k, outcome.seed, asdict(outcome.header), outcome.ops, f.kind, f.message, f.step
                    )
                    budget, replays = workload.zoo_minimize
                    found = handle_failure(failure, target, workload, work, 0, budget, False, replays)
                    return {
                        "caught": True,
                        "cases": k + 1,
                        "capped": False,
                        "seconds": seconds,
                        "kind": f.kind,
                        "trace": str(found.minimized_path) if found.minimized_path else None,
                        "min_ops": found.minimized_ops,
                    }
                if time.monotonic() - start > cap_s and k + 1 < cases:
                    return {"caught": False, "cases": k + 1, "capped": True, "seconds": None, "kind": ""}
    finally:
        events.set_listener(None)
    return {"caught": False, "cases": cases, "capped": False, "seconds": None, "kind": ""}


def minimize_trace(trace_path: str, name: str) -> tuple[int, str] | None:
    """Minimize the failing trace at `trace_path` under bug `name`; returns (ops, path of the
    minimized trace), or None if the trace is unreadable or no longer fails (a property of the
    run, such as liveness, fails the run and not the trace's replay)."""
    try:
        header, ops = trace.read(trace_path)
    except (OSError, trace.TraceError):
        return None  # e.g. the child was killed while writing it
    try:
        with patched(name):
            header, ops, _ = minimize(header, ops, budget=MINIMIZE_BUDGET_S, max_replays=MINIMIZE_REPLAYS)
    except MinimizeError:
        return None
    out = str(Path(trace_path).with_name("minimized.jsonl"))
    trace.write(out, header, ops)
    return len(ops), out


# -- the whole zoo -----------------------------------------------------------------------------


def run_zoo(
    target: Any,
    names: Optional[Sequence[str]],
    out_dir: Path,
    sequences: int = HYPOTHESIS_SEQUENCES,
    cases: Optional[int] = None,
    hypothesis_cap_s: float = HYPOTHESIS_CAP_S,
    fuzz_cap_s: float = FUZZ_CAP_S,
    log: Callable[[str], None] | None = None,
) -> List[ZooRow]:
    """A row for each bug of `target`'s zoo (those of `names`, if given); `cases` (default: the
    workload's zoo budget) fuzz cases each, 0 to skip the fuzzer; the CI profile's first
    `sequences` sequences for a lockstep target."""
    from kvledger.checker.workloads import workload_for

    log = log or _log.info
    cases = workload_for(target).zoo_cases if cases is None else cases
    lockstep = isinstance(target, LockstepTarget)
    rows = []
    for name, origin, bugged in zoo_targets(target):
        if names and name not in names:
            continue
        row = ZooRow(name, origin, hyp_caught=None if not lockstep else False)
        work = out_dir / name
        hyp: Dict[str, Any] = {}
        if lockstep:
            log(f"[{name}] hypothesis (ci profile, first {sequences} sequences) ...")
            hyp = run_hypothesis(name, work / "hypothesis", sequences, hypothesis_cap_s)
            row.hyp_caught, row.hyp_seconds, row.hyp_kind = hyp["caught"], hyp.get("seconds"), hyp.get("kind", "")
            row.hyp_sequences = hyp.get("sequence") if hyp["caught"] else hyp.get("sequences")
            row.hyp_capped = hyp["timed_out"] and not hyp["caught"]
        fz = None
        if cases > 0:
            log(f"[{name}] fuzz (first {cases} cases, seed 0) ...")
            fz = run_fuzz(bugged, cases, work / "fuzz", fuzz_cap_s)
            row.fuzz_caught, row.fuzz_cases, row.fuzz_seconds = fz["caught"], fz["cases"], fz["seconds"]
            row.fuzz_kind, row.fuzz_capped = fz["kind"], fz["capped"]
        if fz and fz.get("min_ops") is not None:
            row.min_ops, row.min_trace = fz["min_ops"], fz["trace"]
        elif hyp.get("trace"):
            row.min_ops, row.min_trace = minimize_trace(hyp["trace"], name) or (None, None)
        rows.append(row)
        log(f"[{name}] " + _row_summary(row))
    return rows


def _count(caught: Optional[bool], count: Optional[int], capped: bool, unit: str) -> str:
    if caught is None:
        return "n/a"
    if caught:
        return f"{unit} {count}"
    return "cap" if capped else f"missed {count}"


def _row_summary(row: ZooRow) -> str:
    return (
        f"hypothesis {_count(row.hyp_caught, row.hyp_sequences, row.hyp_capped, 'sequence')} {row.hyp_kind}; "
        f"fuzz {_count(row.fuzz_caught, row.fuzz_cases, row.fuzz_capped, 'case')} {row.fuzz_kind}; "
        f"min ops {row.min_ops}"
    )


def format_table(rows: Sequence[ZooRow]) -> str:
    head = ("bug", "origin", "caught by", "hypothesis seq", "fuzz case", "min ops", "first divergence")
    body = []
    for r in rows:
        by = [n for n, c in (("hypothesis", r.hyp_caught), ("fuzz", r.fuzz_caught)) if c]
        body.append(
            (
                r.bug,
                r.origin if len(r.origin) <= 44 else r.origin[:41] + "...",
                " + ".join(by) or ("UNDECIDED" if r.undecided else "ESCAPED"),
                _count(r.hyp_caught, r.hyp_sequences, r.hyp_capped, "#"),
                _count(r.fuzz_caught, r.fuzz_cases, r.fuzz_capped, "#"),
                "-" if r.min_ops is None else str(r.min_ops),
                r.hyp_kind or r.fuzz_kind,
            )
        )
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main_zoo(
    target: Any,
    bugs: str | None,
    fuzz_seconds: float,
    out: str | None,
    hypothesis_seconds: float = HYPOTHESIS_CAP_S,
    sequences: int = HYPOTHESIS_SEQUENCES,
    cases: Optional[int] = None,
) -> int:
    """`fuzz_seconds` and `hypothesis_seconds` are safety caps (a fuzz_seconds of 0 skips the
    fuzzer, as before); `sequences` and `cases` are the budgets that decide."""
    from kvledger.checker.workloads import workload_for

    known = [name for name, _, _ in zoo_targets(target)]
    if not known:
        print(
            f"kvledger zoo: {target.name} has no planted bugs, so there is nothing to catch. A builtin "
            "adapter declares its zoo as ZOO, a tuple of SourceEdit (kvledger/subjects/*_zoo.py); for your "
            "own subject, put each planted bug behind a factory of its own (package.module:with_bug) and run "
            "`kvledger check --subject package.module:with_bug` and `kvledger fuzz` on it, which must fail: "
            "see 'Planting bugs in your subject' in docs/checking-your-cache-manager.md",
            file=sys.stderr,
        )
        return 2
    names = known if not bugs else [b.strip() for b in bugs.split(",") if b.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"kvledger zoo: unknown bugs {unknown}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    cases = workload_for(target).zoo_cases if cases is None else cases
    out_dir = Path(out) if out else Path(tempfile.mkdtemp(prefix="kvledger-zoo-"))
    start = time.perf_counter()
    fuzz_cases = cases if fuzz_seconds > 0 else 0
    rows = run_zoo(target, names, out_dir, sequences, fuzz_cases, hypothesis_seconds, fuzz_seconds)
    print(format_table(rows))
    escaped = [r.bug for r in rows if r.escaped]
    undecided = [r.bug for r in rows if r.undecided]
    within = f"{sequences} sequences of the CI profile or {cases} fuzz cases"
    if not isinstance(target, LockstepTarget):
        within = f"{cases} fuzz cases"
    print(
        f"\n{target.name}: {len(rows) - len(escaped) - len(undecided)}/{len(rows)} bugs caught within {within}, "
        f"in {time.perf_counter() - start:.0f}s; traces under {out_dir}"
    )
    if undecided:
        print(f"UNDECIDED (a seconds cap cut the run short of its counts): {', '.join(undecided)}")
    if escaped:
        print(f"ESCAPED: {', '.join(escaped)}")
    return 1 if escaped or undecided else 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--hypothesis-child":
        sys.exit(_hypothesis_child(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])))
    print("usage: kvledger zoo [--bugs a,b] [--hypothesis-sequences N] [--fuzz-cases N]", file=sys.stderr)
    sys.exit(2)
