"""`kvledger zoo --subject SPEC`: does judge mode catch each known bug of a subject's zoo?

A third-party subject's zoo is its adapter's `ZOO`: single edits to the subject's own code, bound
into a fresh instance for every case (the installed package is never touched). The `fast`
subject's zoo is kvledger's own bug zoo (`zoo.py`, 39 bugs), patched into fast's classes for the
run. Each bug gets the judge-mode fuzzer, in this process, case seeds 0, 1, 2, ... until the first
finding or the case budget (`--max-cases`: it decides); the catch is reported as the number of
cases and the seconds it took, with the finding's kind and its minimized length. Cases are counts:
the same budget of cases gives the same table on any machine. The seconds (`--fuzz-seconds`) are a
safety net: a bug they cut short of its cases is `cap`, undecided, not escaped.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterator, List, Sequence

from kvledger.checker.minimize import minimize_ops, shortest_failure
from kvledger.checker.subject_fuzz import run_case
from kvledger.properties.subject import Subject, SubjectConfig
from kvledger.subjects import parse_spec

log = logging.getLogger(__name__)


@dataclass
class SubjectZooRow:
    bug: str
    why: str
    caught: bool = False
    cases: int = 0  # cases run up to and including the catch
    seconds: float = 0.0
    capped: bool = False  # the seconds cap (a safety net) cut the run short of its cases: undecided
    kind: str = ""
    min_ops: int | None = None


def catch(
    factory: Callable[[SubjectConfig], Subject],
    max_cases: int,
    seconds: float,
    minimize_budget: float,
    page_sizes: Sequence[int] = (1, 2, 4),
) -> SubjectZooRow:
    row = SubjectZooRow("", "")
    start = time.monotonic()
    for seed in range(max_cases):
        result = run_case(factory, seed, page_sizes)
        row.cases = seed + 1
        if result.finding is not None:
            row.caught, row.kind = True, result.finding.kind
            row.seconds = time.monotonic() - start
            small, f = minimize_ops(
                factory, result.config, result.ops, row.kind, budget=minimize_budget / 2, max_replays=400
            )
            small, _, _ = shortest_failure(
                factory,
                row.kind,
                small,
                result.config,
                f,
                page_sizes,
                budget=minimize_budget / 2,
                cases=100,
                run_case=run_case,
            )
            row.min_ops = len(small)
            return row
        if time.monotonic() - start > seconds and seed + 1 < max_cases:
            row.capped = True
            break
    row.seconds = time.monotonic() - start
    return row


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def run_subject_zoo(
    text: str,
    bugs: Sequence[str] | None = None,
    max_cases: int = 2000,
    seconds: float = 60.0,
    minimize_budget: float = 15.0,
) -> List[SubjectZooRow]:
    spec = parse_spec(text)
    # built once before any timing: the first build imports the subject (vLLM, SGLang: seconds)
    spec.factory(spec.zoo_base())(SubjectConfig(num_pages=8, page_size=spec.page_sizes()[0], max_seq_len=16))
    rows = []
    if spec.name == "fast":
        from kvledger.subjects.fast_zoo import BUGS, patched

        entries = [(name, BUGS[name].description, lambda name=name: patched(name), ()) for name in sorted(BUGS)]
    else:
        base = spec.zoo_base()
        entries = [(e.name, e.why, _nothing, base + (e,)) for e in spec.zoo()]
    for name, why, context, edits in entries:
        if bugs and name not in bugs:
            continue
        with context():
            row = catch(spec.factory(edits), max_cases, seconds, minimize_budget, spec.page_sizes())
        row.bug, row.why = name, why
        log.info(
            "%s: %s",
            name,
            f"caught ({row.kind}) after {row.cases} cases, {row.seconds:.1f} s"
            if row.caught
            else f"UNDECIDED: the seconds cap stopped it after {row.cases} cases"
            if row.capped
            else f"ESCAPED {row.cases} cases",
        )
        rows.append(row)
    return rows


def verdict(row: SubjectZooRow) -> str:
    return "yes" if row.caught else "cap" if row.capped else "NO"


def print_subject_zoo(text: str, rows: List[SubjectZooRow]) -> None:
    width = max([len(r.bug) for r in rows] + [3])
    print(f"{'bug':<{width}}  caught  cases  seconds  min ops  finding")
    for r in rows:
        print(
            f"{r.bug:<{width}}  {verdict(r):<6}  {r.cases:>5}  {r.seconds:>7.1f}  "
            f"{r.min_ops if r.min_ops is not None else '-':>7}  {r.kind}"
        )
    caught = sum(r.caught for r in rows)
    print(f"{text}: judge mode caught {caught} of {len(rows)}")
