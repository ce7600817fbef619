"""`kvledger zoo`: which property run catches which bug of the zoo, how fast, how small.

For each bug (see `zoo.py`):
  hypothesis  the CI profile of the lockstep state machine (derandomized, without shrinking),
              run with the bug patched in, in a child process killed after a time cap;
              caught = the run raised; the time is to the first failing sequence.
  fuzz        the random-walk fuzzer (`properties/fuzz.py`), two workers, seed 0.
  min ops     the length of the minimized failing trace: the fuzzer's, else the Hypothesis
              failing trace run through `properties/minimize.py`.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from kvledger.engine.ledger import trace
from kvledger.subjects.fast_zoo import BUGS, patched

_log = logging.getLogger(__name__)  # `log` is run_zoo's callback

HYPOTHESIS_CAP_S = 45.0
MINIMIZE_BUDGET_S = 15.0
_FIRST_CATCH = "first-catch.json"


@dataclass
class ZooRow:
    bug: str
    origin: str
    hyp_caught: bool = False
    hyp_seconds: Optional[float] = None
    hyp_kind: str = ""
    hyp_capped: bool = False  # stopped at the time cap before the profile finished
    fuzz_caught: Optional[bool] = None  # None: the fuzzer is not available
    fuzz_seconds: Optional[float] = None
    fuzz_kind: str = ""
    min_ops: Optional[int] = None
    min_trace: Optional[str] = None

    @property
    def escaped(self) -> bool:
        return not self.hyp_caught and not self.fuzz_caught


# -- Hypothesis, in a child process ------------------------------------------------------------


def _hypothesis_child(name: str, out: Path) -> int:
    """Run the CI profile with `name` patched in; record the first catch in `out` at once (the
    parent kills us at its time cap)."""
    from hypothesis import Phase, settings

    from kvledger.properties.machine import LockstepMachine, run_machine
    from kvledger.properties.profiles import register_profiles

    start = time.perf_counter()
    first: Dict[str, Any] = {}

    # Time the first catch by wrapping the machine's step in place: a subclass would change the
    # test's identity and with it the derandomized examples, so it would not be the CI run.
    step = LockstepMachine._do

    def timed_do(self: LockstepMachine, op: Dict) -> Dict:
        try:
            return step(self, op)
        except Exception as e:
            if not first:
                first.update(seconds=time.perf_counter() - start, kind=getattr(e, "kind", type(e).__name__))
                (out / _FIRST_CATCH).write_text(json.dumps(first))
            raise

    LockstepMachine._do = timed_do  # this child process only
    register_profiles("ci")
    # No shrinking: Hypothesis stops at the first failing sequence, which minimize.py shrinks
    # (far faster than Hypothesis shrinking a stateful run).
    phases = [p for p in settings.default.phases if p is not Phase.shrink]
    with patched(name):
        try:
            run_machine(settings(settings.default, phases=phases))
        except Exception as e:  # caught: Hypothesis re-raises the failure
            result = {
                **first,
                "caught": True,
                "final_kind": getattr(e, "kind", type(e).__name__),
                "total_seconds": time.perf_counter() - start,
            }
        else:
            result = {"caught": False, "total_seconds": time.perf_counter() - start}
    (out / "result.json").write_text(json.dumps(result))
    return 0


def run_hypothesis(name: str, work: Path, cap_s: float = HYPOTHESIS_CAP_S) -> Dict[str, Any]:
    """The CI profile against bug `name`, at most `cap_s` seconds. Returns caught, seconds (to
    the first failure), kind, timed_out and, if caught, the failing trace's path."""
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "KVLEDGER_FAILURES": str(work), "HYPOTHESIS_PROFILE": "ci"}
    cmd = [sys.executable, "-m", "kvledger.checker.audit.zoo_run", "--hypothesis-child", name, str(work)]
    timed_out, stderr = False, ""
    try:
        proc = subprocess.run(
            cmd,
            env=env,
            timeout=cap_s,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
            check=False,
        )
        stderr = proc.stderr
    except subprocess.TimeoutExpired:  # subprocess.run kills the child
        timed_out = True
    if (work / "result.json").exists():
        result = json.loads((work / "result.json").read_text())
    elif (work / _FIRST_CATCH).exists():  # killed at the cap after the first catch
        result = {**json.loads((work / _FIRST_CATCH).read_text()), "caught": True}
    elif timed_out:
        result = {"caught": False}
    else:
        raise RuntimeError(f"the Hypothesis run for {name} failed to start:\n{stderr[-2000:]}")
    result["timed_out"] = timed_out
    failing = work / "hypothesis-last-failure.jsonl"
    if result["caught"] and failing.exists():
        result["trace"] = str(failing)
    return result


# -- the fuzzer and the minimizer (sibling modules, used when present) ------------------------


def _fuzz_fn():
    try:
        from kvledger.checker.fuzz import fuzz
    except ImportError:
        return None
    return fuzz


def _minimize_fn():
    try:
        from kvledger.checker.minimize import minimize
    except ImportError:
        return None
    return minimize


def run_fuzz(name: str, seconds: float, work: Path) -> Dict[str, Any] | None:
    """The fuzzer against bug `name` (two workers, seed 0); None if properties/fuzz.py is missing."""
    fuzz = _fuzz_fn()
    if fuzz is None:
        return None
    res = fuzz(seconds, workers=2, seed=0, out_dir=work, bug=name, progress=False, minimize_budget=MINIMIZE_BUDGET_S)
    f = res.failure
    if f is None:
        return {"caught": False, "seconds": None, "kind": "", "trace": None, "min_ops": None}
    return {
        "caught": True,
        "seconds": res.seconds_to_find,
        "kind": f.kind,
        "trace": str(f.minimized_path) if f.minimized_path else None,
        "min_ops": f.minimized_ops,
    }


def minimize_trace(trace_path: str, name: str) -> tuple[int, str] | None:
    """Minimize the failing trace at `trace_path` under bug `name`; returns (ops, path of the
    minimized trace), or None if the trace is unreadable or no longer fails."""
    try:
        header, ops = trace.read(trace_path)
    except (OSError, trace.TraceError):
        return None  # e.g. the child was killed while writing it
    minimize = _minimize_fn()
    if minimize is None:
        return len(ops), trace_path
    from kvledger.checker.minimize import MinimizeError

    try:
        with patched(name):
            header, ops, _ = minimize(header, ops, budget=MINIMIZE_BUDGET_S)
    except MinimizeError:
        return None
    out = str(Path(trace_path).with_name("minimized.jsonl"))
    trace.write(out, header, ops)
    return len(ops), out


# -- the whole zoo -----------------------------------------------------------------------------


def run_zoo(
    names: Sequence[str],
    fuzz_seconds: float,
    out_dir: Path,
    hypothesis_cap_s: float = HYPOTHESIS_CAP_S,
    log: Callable[[str], None] | None = None,
) -> List[ZooRow]:
    log = log or _log.info
    rows = []
    for name in names:
        bug = BUGS[name]
        row = ZooRow(name, bug.origin)
        work = out_dir / name
        log(f"[{name}] hypothesis (ci profile, cap {hypothesis_cap_s:.0f}s) ...")
        hyp = run_hypothesis(name, work / "hypothesis", hypothesis_cap_s)
        row.hyp_caught, row.hyp_seconds, row.hyp_kind = hyp["caught"], hyp.get("seconds"), hyp.get("kind", "")
        row.hyp_capped = hyp["timed_out"] and not hyp["caught"]
        fz = None
        if fuzz_seconds > 0:
            log(f"[{name}] fuzz ({fuzz_seconds:.0f}s, 2 workers) ...")
            fz = run_fuzz(name, fuzz_seconds, work / "fuzz")
            if fz is not None:
                row.fuzz_caught, row.fuzz_seconds, row.fuzz_kind = fz["caught"], fz["seconds"], fz["kind"]
        if fz and fz["min_ops"] is not None:
            row.min_ops, row.min_trace = fz["min_ops"], fz["trace"]
        elif hyp.get("trace"):
            row.min_ops, row.min_trace = minimize_trace(hyp["trace"], name) or (None, None)
        rows.append(row)
        log(f"[{name}] " + _row_summary(row))
    return rows


def _secs(caught: Optional[bool], seconds: Optional[float]) -> str:
    if caught is None:
        return "n/a"
    if not caught:
        return "missed"
    return f"{seconds:.1f}s" if seconds is not None else "yes"


def _row_summary(row: ZooRow) -> str:
    return (
        f"hypothesis {_secs(row.hyp_caught, row.hyp_seconds)} {row.hyp_kind}; "
        f"fuzz {_secs(row.fuzz_caught, row.fuzz_seconds)} {row.fuzz_kind}; min ops {row.min_ops}"
    )


def format_table(rows: Sequence[ZooRow]) -> str:
    head = ("bug", "origin", "caught by", "hypothesis", "fuzz", "min ops", "first divergence")
    body = []
    for r in rows:
        by = [n for n, c in (("hypothesis", r.hyp_caught), ("fuzz", r.fuzz_caught)) if c]
        body.append(
            (
                r.bug,
                r.origin if len(r.origin) <= 44 else r.origin[:41] + "...",
                " + ".join(by) or "ESCAPED",
                _secs(r.hyp_caught, r.hyp_seconds) + (" (cap)" if r.hyp_capped else ""),
                _secs(r.fuzz_caught, r.fuzz_seconds),
                "-" if r.min_ops is None else str(r.min_ops),
                r.hyp_kind or r.fuzz_kind,
            )
        )
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main_zoo(
    bugs: str | None, fuzz_seconds: float, out: str | None, hypothesis_seconds: float = HYPOTHESIS_CAP_S
) -> int:
    names = list(BUGS) if not bugs else [b.strip() for b in bugs.split(",") if b.strip()]
    unknown = [n for n in names if n not in BUGS]
    if unknown:
        print(f"kvledger zoo: unknown bugs {unknown}; known: {', '.join(BUGS)}", file=sys.stderr)
        return 2
    out_dir = Path(out) if out else Path(tempfile.mkdtemp(prefix="kvledger-zoo-"))
    start = time.perf_counter()
    rows = run_zoo(names, fuzz_seconds, out_dir, hypothesis_seconds)
    print(format_table(rows))
    escaped = [r.bug for r in rows if r.escaped]
    missing_fuzz = any(r.fuzz_caught is None for r in rows) and fuzz_seconds > 0
    print(
        f"\n{len(rows) - len(escaped)}/{len(rows)} bugs caught in {time.perf_counter() - start:.0f}s; "
        f"traces under {out_dir}"
    )
    if missing_fuzz:
        print("fuzz column n/a: properties/fuzz.py is not there yet")
    if escaped:
        print(f"ESCAPED both: {', '.join(escaped)}")
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--hypothesis-child":
        sys.exit(_hypothesis_child(sys.argv[2], Path(sys.argv[3])))
    print("usage: kvledger zoo [--bugs a,b] [--fuzz-seconds N] [--out-dir DIR]", file=sys.stderr)
    sys.exit(2)
