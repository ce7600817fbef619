"""`kvledger coverage`: line and branch coverage of `fast/` by the Hypothesis property run alone.

The suite runs in a fresh interpreter under coverage.py (branch coverage, source `fast`), so the
module-level lines of `fast/` count as they are imported; the report is read back from the data
file: coverage's own table, then line and branch totals.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Optional

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger(__name__)


def run_suite(examples: Optional[int] = None) -> None:
    """The property run as the test suite runs it: the ci profile, LockstepMachine."""
    os.environ.setdefault("HYPOTHESIS_PROFILE", "ci")
    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test

    from kvledger.properties.machine import LockstepMachine

    chosen = settings(settings.default, max_examples=examples) if examples else settings.default
    run_state_machine_as_test(LockstepMachine, settings=chosen)


def measure(examples: Optional[int] = None, data_file: Optional[Path] = None) -> Dict:
    """Run the suite under coverage in a subprocess; returns coverage's JSON report (totals and
    per file). Raises RuntimeError if the suite fails."""
    tmp = Path(tempfile.mkdtemp(prefix="kvledger-coverage-"))
    data_file = data_file or tmp / ".coverage"
    cmd = [sys.executable, "-m", "coverage", "run", "--branch", "--source=fast", f"--data-file={data_file}",
           "-m", "kvledger.tools.coverage_report", "--run-suite"]
    if examples:
        cmd.append(str(examples))
    env = {**os.environ, "HYPOTHESIS_PROFILE": "ci", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the property run failed under coverage:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    import coverage

    cov = coverage.Coverage(data_file=str(data_file), branch=True)
    cov.load()
    json_path = tmp / "coverage.json"
    cov.json_report(outfile=str(json_path))
    report = json.loads(json_path.read_text())
    report["_table"] = _table(cov)
    return report


def _table(cov) -> str:
    import io

    buf = io.StringIO()
    cov.report(file=buf, show_missing=True)
    return buf.getvalue()


def format_totals(report: Dict) -> str:
    t = report["totals"]
    lines = (t["covered_lines"], t["num_statements"])
    branches = (t["covered_branches"], t["num_branches"])
    pct = lambda a, b: 100.0 * a / b if b else 100.0  # noqa: E731
    return (f"fast/ line coverage:   {lines[0]}/{lines[1]} ({pct(*lines):.1f}%)\n"
            f"fast/ branch coverage: {branches[0]}/{branches[1]} ({pct(*branches):.1f}%)")


def main_coverage(examples: Optional[int] = None) -> int:
    log.info("kvledger coverage: the Hypothesis property run (ci profile%s) under coverage.py, branch coverage "
             "of fast/", f", {examples} examples" if examples else "")
    try:
        report = measure(examples)
    except RuntimeError as e:
        log.error("kvledger coverage: %s", e)
        return 1
    print(report["_table"])
    print(format_totals(report))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run-suite"]:
        run_suite(int(sys.argv[2]) if len(sys.argv) > 2 else None)
    else:
        from kvledger.engine.cli_parser import configure_logging

        configure_logging()
        sys.exit(main_coverage())
