"""Checking a cache manager from a project's own test suite: `check_subject` runs the CI profile
of a subject (the run `kvledger check --subject` makes) and, optionally, a seeded fuzz of a few
cases (the run `kvledger fuzz` makes), and fails with a `SubjectFinding` that holds the minimized
trace, where it was written and the `kvledger replay` command that repeats it.

    from kvledger.checker.testing import check_subject

    def test_my_cache_is_judged_clean(tmp_path):
        check_subject("my_project.kv_adapter:factory", out_dir=tmp_path)

Nothing here is imported by kvledger's own commands: a derandomized Hypothesis run draws from the
literals of every loaded module, so loading this one would change what `kvledger check` explores.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import tempfile
from pathlib import Path
from typing import Callable, List, Optional, Union

from kvledger.properties.subject import Subject, SubjectConfig
from kvledger.properties.target import SubjectTarget

SubjectLike = Union[str, Callable[[SubjectConfig], Subject], SubjectTarget]


class SubjectFinding(AssertionError):
    """The judge failed a subject: `kind` (e.g. "4-failed-admission"), its message, the minimized
    trace's operations (JSON lines), the trace file and the command that replays it."""

    def __init__(self, kind: str, message: str, ops: List[str], trace_path: Path, replay: str, report: str) -> None:
        self.kind, self.message, self.ops = kind, message, ops
        self.trace_path, self.replay = trace_path, replay
        self.report = report
        lines = [f"[{kind}] {message}", f"minimized trace, {len(ops)} operations: {trace_path}", f"  {replay}"]
        lines += ["  " + op for op in ops]
        super().__init__("\n".join(lines) + ("\n\n" + report if report else ""))


def as_target(subject: SubjectLike) -> SubjectTarget:
    """A target for a spec ("minisgl", "package.module:factory"), a factory or a target as is."""
    if isinstance(subject, SubjectTarget):
        return subject
    if isinstance(subject, str):
        from kvledger.checker.targets import subject_target

        return subject_target(subject)
    # the spec text a module-level factory is replayed by; a lambda's or a local's name only labels the trace
    name = f"{getattr(subject, '__module__', 'subject')}:{getattr(subject, '__qualname__', 'factory')}"
    return SubjectTarget(subject, re.sub(r"[^\w.:]", "_", name))


def check_subject(
    subject: SubjectLike,
    *,
    profile: str = "ci",
    examples: Optional[int] = None,
    fuzz_cases: int = 0,
    seed: int = 0,
    out_dir: Optional[Union[str, Path]] = None,
    minimize_budget: float = 30.0,
) -> str:
    """Run `profile` (`examples` sequences instead of the profile's; 0 skips it) on `subject`,
    then `fuzz_cases` fuzz cases of seed `seed`; return the run's report, or raise `SubjectFinding`
    with the first failure, minimized and written under `out_dir` (a fresh temporary folder when
    None). Counts decide, never time: the same arguments give the same result on any machine."""
    from kvledger.checker.check import run_check

    target = as_target(subject)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="kvledger-check-"))
    report = ""
    if examples != 0:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = run_check(target, profile, examples, out, minimize_budget)
        report = printed.getvalue()
        if code == 1:
            raise _from_check_report(report)
        if code != 0:
            raise RuntimeError(f"kvledger check on {target.name} exited {code}:\n{report}")
    if fuzz_cases > 0:
        report += _fuzz(target, fuzz_cases, seed, out / "fuzz", minimize_budget)
    return report


def _from_check_report(report: str) -> SubjectFinding:
    """The finding `run_check` printed: "FAILED ...: [kind] message", then "the failing trace, N
    operations: PATH (kvledger replay PATH)" and the operations, one JSON line each."""
    head = re.search(r"^FAILED [^:]*: \[([^\]]+)\] (.*)$", report, re.M)
    where = re.search(r"^the failing trace, \d+ operations: (\S+) \((kvledger replay [^)]*)\)$", report, re.M)
    if head is None or where is None:
        return SubjectFinding("unknown", "kvledger check failed", [], Path("?"), "", report)
    ops = [line.strip() for line in report[where.end() :].splitlines() if line.startswith("  {")]
    return SubjectFinding(head.group(1), head.group(2), ops, Path(where.group(1)), where.group(2), report)


def _fuzz(target: SubjectTarget, cases: int, seed: int, out: Path, budget: float) -> str:
    """`cases` fuzz cases of one worker with seed `seed` (the zoo's loop); the first finding is
    written, minimized and raised."""
    from dataclasses import asdict

    from kvledger.checker.fuzz import WorkerFailure, handle_failure
    from kvledger.checker.isolated_runs import Cases
    from kvledger.checker.workloads import workload_for
    from kvledger.engine.ledger import trace
    from kvledger.engine.ledger.ops import as_record

    workload = workload_for(target)
    workload.prepare()
    # in the target's sandbox: a subject that kills its process fails this test, not pytest
    with target.active(), Cases(workload, target.isolation) as play:
        for k in range(cases):
            outcome = play(k, workload.case_seed(seed, 0, 1, k))
            f = outcome.finding
            if f is None:
                continue
            failure = WorkerFailure(
                0, k, outcome.seed, asdict(outcome.header), outcome.ops, f.kind, f.message, f.step, f.detail
            )
            # the zoo's cap on replays, so a count, not the clock, ends the minimizer's search
            found = handle_failure(failure, target, workload, out, seed, budget, False, workload.zoo_minimize[1])
            path = found.minimized_path or found.trace_path
            _, ops = trace.read(path)
            lines = [json.dumps(as_record(op).to_json()) for op in ops]
            kind = found.minimized_kind or found.kind
            raise SubjectFinding(kind, f.message.strip(), lines, path, f"kvledger replay {path}", "")
    return f"fuzz: {cases} cases of seed {seed}, no finding\n"
