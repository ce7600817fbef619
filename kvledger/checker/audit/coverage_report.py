"""`kvledger coverage`: line and branch coverage of the cache logic by the Hypothesis property run alone.

Measured: every file of `fast/` and the scheduler-side cache logic (`engine/ledger/cache_scheduler.py`,
`engine/ledger/divergence.py`). The property run (the ci profile, `LockstepMachine`) runs in a fresh
interpreter under coverage.py with branch coverage, so module-level lines count as they are
imported; the report is read back from the data file.

A line the property run cannot reach (argument validation for bad constructor arguments, a path
only the engine or a GPU takes) is listed with its reason in `properties/coverage-exclusions.txt`
(`path:line  reason`, `path:first-last  reason` or `path:from->to  reason` for a branch, one a
line). The report sets every uncovered line against that list:
uncovered and listed is accounted for, uncovered and unlisted is a gap, listed but covered is a
stale entry (tests/properties/test_lockstep_machine.py keeps the list exactly true for the ci profile).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[3]  # kvledger/checker/audit/ -> the repository
EXCLUSIONS = ROOT / "properties" / "coverage-exclusions.txt"
# measured: the cache manager and everything under it, and the scheduler-side cache logic
MEASURED = ("fast/*", "engine/ledger/cache_scheduler.py", "engine/ledger/divergence.py")
log = logging.getLogger(__name__)


def run_suite(examples: Optional[int] = None) -> None:
    """The property run as the test suite runs it: the ci profile, LockstepMachine.TestCase."""
    from hypothesis import settings

    from kvledger.properties.machine import run_machine
    from kvledger.properties.profiles import register_profiles

    register_profiles("ci")
    run_machine(settings(settings.default, max_examples=examples) if examples else None)


def start_coverage(data_file: Path):
    """A started coverage.py measurement of the MEASURED files (branch coverage)."""
    import coverage

    cov = coverage.Coverage(
        data_file=str(data_file), branch=True, include=[str(ROOT / pattern) for pattern in MEASURED]
    )
    cov.start()
    return cov


def report_from(data_file: Path) -> Dict:
    """coverage's JSON report (totals and per file, paths relative to the repository) of a data
    file, with coverage's own table under "_table"."""
    import io

    import coverage

    cov = coverage.Coverage(data_file=str(data_file), branch=True)
    cov.load()
    json_path = Path(tempfile.mkdtemp(prefix="kvledger-coverage-")) / "coverage.json"
    cov.json_report(outfile=str(json_path))
    report = json.loads(json_path.read_text())
    report["files"] = {_relative(name): data for name, data in report["files"].items()}
    buf = io.StringIO()
    cov.report(file=buf, show_missing=True)
    report["_table"] = buf.getvalue().replace(str(ROOT) + os.sep, "")
    return report


def _relative(name: str) -> str:
    path = Path(name)
    return path.resolve().relative_to(ROOT).as_posix() if path.is_absolute() else path.as_posix()


def measure(examples: Optional[int] = None, data_file: Optional[Path] = None) -> Dict:
    """Run the suite under coverage in a subprocess; returns `report_from` of its data. Raises
    RuntimeError if the suite fails."""
    data_file = data_file or Path(tempfile.mkdtemp(prefix="kvledger-coverage-")) / ".coverage"
    cmd = [sys.executable, "-m", "kvledger.checker.audit.coverage_report", "--run-suite", str(data_file)]
    if examples:
        cmd.append(str(examples))
    env = {
        **os.environ,
        "HYPOTHESIS_PROFILE": "ci",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the property run failed under coverage:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return report_from(data_file)


# -- the reviewed list of lines the property run cannot reach ---------------------------------


@dataclass(frozen=True)
class Exclusion:
    path: str
    line: int
    reason: str
    to: Optional[int] = None  # set: the branch line -> to (to < 0: an exit), not the line


def read_exclusions(path: Path = EXCLUSIONS) -> List[Exclusion]:
    """`path:line  reason`, `path:first-last  reason` (every line of the range) or
    `path:from->to  reason` (one branch) entries; blank lines and lines starting with # are
    skipped. An entry without a reason, or whose place is none of those, is an error."""
    out = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        where, _, reason = text.partition(" ")
        file, _, span = where.rpartition(":")
        source, arrow, to = span.partition("->")
        first, dash, last = source.partition("-")
        last = last if dash else first
        if (
            not file
            or not reason.strip()
            or not first.isdigit()
            or not last.isdigit()
            or int(last) < int(first)
            or (arrow and (dash or not to.lstrip("-").isdigit()))
        ):
            raise ValueError(
                f"{path.name}:{number}: expected 'path:line  reason', 'path:first-last  reason' or "
                f"'path:from->to  reason', got {raw!r}"
            )
        if arrow:
            out.append(Exclusion(file, int(first), reason.strip(), int(to)))
        else:
            out += [Exclusion(file, line, reason.strip()) for line in range(int(first), int(last) + 1)]
    return out


@dataclass
class FileCoverage:
    path: str
    lines: Tuple[int, int]  # covered, statements
    branches: Tuple[int, int]  # covered, branches
    listed: List[int] = field(default_factory=list)  # uncovered and listed
    unlisted: List[int] = field(default_factory=list)  # uncovered, not listed: a gap
    stale: List[str] = field(default_factory=list)  # listed, but covered (or not a statement / a branch)
    missing_branches: List[Tuple[int, int]] = field(default_factory=list)  # (from, to); to < 0: an exit
    unlisted_branches: List[Tuple[int, int]] = field(default_factory=list)  # neither end listed: a gap

    @property
    def accounted(self) -> Tuple[float, float]:
        """Percent of statements, and of branches, covered or listed (a branch is listed when the
        line it starts or lands on is)."""
        (lines, statements), (_, total) = self.lines, self.branches
        return (
            100.0 * (lines + len(self.listed)) / statements if statements else 100.0,
            100.0 * (total - len(self.unlisted_branches)) / total if total else 100.0,
        )


def against_exclusions(report: Dict, exclusions: List[Exclusion]) -> List[FileCoverage]:
    """Each measured file's coverage, its uncovered lines and branches set against the list."""
    lines_of: Dict[str, set] = {}
    branches_of: Dict[str, set] = {}
    for e in exclusions:
        if e.to is None:
            lines_of.setdefault(e.path, set()).add(e.line)
        else:
            branches_of.setdefault(e.path, set()).add((e.line, e.to))
    out = []
    for name in sorted(set(report["files"]) | set(lines_of) | set(branches_of)):
        data = report["files"].get(name)
        listed, listed_branches = lines_of.get(name, set()), branches_of.get(name, set())
        if data is None:
            out.append(
                FileCoverage(
                    name,
                    (0, 0),
                    (0, 0),
                    stale=[f"{n}" for n in sorted(listed)] + [f"{a}->{b}" for a, b in sorted(listed_branches)],
                )
            )
            continue
        s = data["summary"]
        missing = set(data["missing_lines"])
        branches = [tuple(b) for b in data.get("missing_branches", [])]
        out.append(
            FileCoverage(
                name,
                (s["covered_lines"], s["num_statements"]),
                (s["covered_branches"], s["num_branches"]),
                listed=sorted(missing & listed),
                unlisted=sorted(missing - listed),
                stale=[str(n) for n in sorted(listed - missing)]
                + [f"{a}->{b}" for a, b in sorted(listed_branches - set(branches))],
                missing_branches=branches,
                unlisted_branches=[
                    b for b in branches if b not in listed_branches and b[0] not in listed and b[1] not in listed
                ],
            )
        )
    return out


def _pct(a: int, b: int) -> str:
    return f"{100.0 * a / b:5.1f}%" if b else "  n/a "


def format_files(files: List[FileCoverage]) -> str:
    rows = [("file", "lines", "", "branches", "", "listed", "with listed", "unlisted lines", "unlisted branches")]
    for f in files:
        rows.append(
            (
                f.path,
                f"{f.lines[0]}/{f.lines[1]}",
                _pct(*f.lines),
                f"{f.branches[0]}/{f.branches[1]}",
                _pct(*f.branches),
                str(len(f.listed)),
                "/".join(f"{p:.1f}%" for p in f.accounted),
                ",".join(map(str, f.unlisted)) or "-",
                ",".join(f"{a}->{b}" for a, b in f.unlisted_branches) or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    stale = [f"{f.path}:{where}" for f in files for where in f.stale]
    if stale:
        lines.append(f"stale exclusions (listed, but covered or not a statement): {', '.join(stale)}")
    return "\n".join(lines)


def format_totals(report: Dict) -> str:
    t = report["totals"]
    lines = (t["covered_lines"], t["num_statements"])
    branches = (t["covered_branches"], t["num_branches"])
    return (
        f"line coverage:   {lines[0]}/{lines[1]} ({_pct(*lines).strip()})\n"
        f"branch coverage: {branches[0]}/{branches[1]} ({_pct(*branches).strip()})"
    )


def main_coverage(examples: Optional[int] = None) -> int:
    log.info(
        "kvledger coverage: the Hypothesis property run (ci profile%s) under coverage.py, line and branch "
        "coverage of %s",
        f", {examples} examples" if examples else "",
        ", ".join(MEASURED),
    )
    try:
        report = measure(examples)
    except RuntimeError as e:
        log.error("kvledger coverage: %s", e)
        return 1
    files = against_exclusions(report, read_exclusions())
    print(report["_table"])
    print(format_files(files))
    print(format_totals(report))
    gaps = sum(len(f.unlisted) for f in files)
    print(
        f"{gaps} uncovered lines not in {EXCLUSIONS.relative_to(ROOT)}"
        if gaps
        else f"every uncovered line is listed in {EXCLUSIONS.relative_to(ROOT)}"
    )
    return 0


def _run_suite_under_coverage(data_file: Path, examples: Optional[int]) -> None:
    cov = start_coverage(data_file)
    try:
        run_suite(examples)
    finally:
        cov.stop()
        cov.save()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run-suite"]:
        _run_suite_under_coverage(Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
    else:
        logging.basicConfig(level=logging.WARNING, format="%(message)s")  # as `kvledger coverage`
        logging.getLogger("kvledger").setLevel(logging.INFO)
        sys.exit(main_coverage())
