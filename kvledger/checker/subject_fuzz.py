"""`kvledger fuzz --subject SPEC`: random walks over one subject in judge mode.

Each case draws a pool shape and prompt stems (`properties/subject_workload.py`), walks up to
`MAX_OPS` operations through the `SubjectDriver` (the judge after every one), then drains every
request to its end, where quiescence is judged, and liveness for a subject that preempts
(`subject_workload.drain`); the driver judges each refusal at the admission itself
(4-failed-admission). A case is a seed: worker w runs seeds `seed * 1_000_003 + w + k * workers`,
so the same seed and workers give the same cases on any machine; `--max-cases` makes the amount
of work machine-independent too (`--seconds` is only a budget). The first finding of each kind is
written as a trace, minimized, next to it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

from kvledger.engine.ledger import trace
from kvledger.engine.ledger.ops import InvalidOp, OpResult
from kvledger.properties.subject import Subject, SubjectConfig
from kvledger.properties.subject_driver import Finding, SubjectDriver
from kvledger.properties.subject_workload import DRAIN_LIMIT, drain, draw_shape, next_op, stalled_after
from kvledger.subjects import SubjectSpec, parse_spec
from kvledger.subjects.edits import SourceEdit

log = logging.getLogger(__name__)
MAX_OPS = 40


@dataclass
class CaseResult:
    seed: int
    config: SubjectConfig
    ops: List[Dict[str, Any]]
    finding: Finding | None
    events: Dict[str, int] = field(default_factory=dict)  # event -> the op index that first reached it


def run_case(
    factory: Callable[[SubjectConfig], Subject],
    seed: int,
    page_sizes: Sequence[int] = (1, 2, 4),
    max_ops: int = MAX_OPS,
) -> CaseResult:
    rng = random.Random(seed)
    shape = draw_shape(rng, page_sizes)
    events: Dict[str, int] = {}
    ops: List[Dict[str, Any]] = []
    result = CaseResult(seed, shape.config, ops, None, events)
    try:
        driver = SubjectDriver(
            factory(shape.config), shape.config, on_event=lambda name: events.setdefault(name, len(ops))
        )
    except Finding as f:
        result.finding = f
        return result
    history: List[List[int]] = []
    uid = 0

    def apply(op: Dict[str, Any]) -> OpResult | None:
        try:
            out = driver.apply(op)
        except InvalidOp:  # never recorded: the trace keeps valid operations only
            return None
        except Finding:  # the trace ends with the operation that raised it
            ops.append(op)
            raise
        ops.append(op)
        return out

    stalled = 0
    try:
        for _ in range(max_ops):
            op = next_op(rng, shape, driver, uid, history)
            out = None if op is None else apply(op)
            if op is None or out is None:
                continue
            uid += op["op"] == "submit"
            stalled = stalled_after(stalled, op, out)
        drain(driver, apply, DRAIN_LIMIT, stalled)
    except Finding as f:
        result.finding = f
    return result


def header_for(spec: SubjectSpec, version: str, config: SubjectConfig, seed: int | None) -> trace.Header:
    return trace.Header(
        num_pages=config.num_pages,
        page_size=config.page_size,
        cache_type="radix",
        table_slots=config.max_running,
        max_seq_len=config.max_seq_len,
        seed=seed,
        producer="kvledger fuzz --subject",
        subject=spec.text,
        subject_version=version,
    )


def config_of(header: trace.Header) -> SubjectConfig:
    return SubjectConfig(
        num_pages=header.num_pages,
        page_size=header.page_size,
        max_seq_len=header.max_seq_len,
        max_running=header.table_slots,
    )


@dataclass
class FuzzReport:
    cases: int = 0
    ops: int = 0
    seconds: float = 0.0
    findings: Dict[str, Tuple[int, str]] = field(default_factory=dict)  # kind -> (seed, message)
    events: Dict[str, int] = field(default_factory=dict)  # event -> cases that reached it
    traces: List[Path] = field(default_factory=list)


def _worker(args: Tuple[str, Tuple[SourceEdit, ...], int, int, int, float, int | None, Tuple[int, ...]]) -> Dict:
    text, edits, seed, worker, workers, seconds, max_cases, page_sizes = args
    logging.getLogger().setLevel(logging.WARNING)
    factory = parse_spec(text).factory(edits)
    deadline = time.monotonic() + seconds
    out: Dict[str, Any] = {"cases": 0, "ops": 0, "findings": {}, "events": {}}
    k = 0
    while time.monotonic() < deadline and (max_cases is None or k < max_cases):
        case_seed = seed * 1_000_003 + worker + k * workers
        k += 1
        result = run_case(factory, case_seed, page_sizes)
        out["cases"] += 1
        out["ops"] += len(result.ops)
        for name in result.events:
            out["events"][name] = out["events"].get(name, 0) + 1
        if result.finding is not None and result.finding.kind not in out["findings"]:
            out["findings"][result.finding.kind] = (
                case_seed,
                result.finding.message,
                result.config,
                result.ops,
                result.finding.detail,
            )
    return out


def minimize_finding(
    factory: Callable[[SubjectConfig], Subject],
    config: SubjectConfig,
    ops: List[Dict[str, Any]],
    kind: str,
    page_sizes: Sequence[int],
    budget: float,
    max_replays: int | None = None,
) -> Tuple[List[Dict[str, Any]], SubjectConfig]:
    """A finding's trace made small: delta debugging on its operations, then a search of short
    cases for the same finding (half the budget each); returns the operations and their config."""
    from kvledger.checker.minimize import minimize_ops, shortest_failure

    small, finding = minimize_ops(factory, config, ops, kind, budget=budget / 2, max_replays=max_replays)
    small, small_config, _ = shortest_failure(
        factory, kind, small, config, finding, page_sizes, budget=budget / 2, run_case=run_case
    )
    return small, small_config


def fuzz_subject(
    text: str,
    seconds: float,
    *,
    workers: int = 1,
    seed: int = 0,
    out_dir: str | Path = ".kvledger/fuzz",
    edits: Sequence[SourceEdit] = (),
    minimize_budget: float = 60.0,
    max_cases: int | None = None,
    page_sizes: Sequence[int] | None = None,
    minimize_replays: int | None = None,
) -> FuzzReport:
    spec = parse_spec(text)
    page_sizes = spec.page_sizes(page_sizes or (1, 2, 4))
    factory = spec.factory(edits)
    probe = factory(SubjectConfig(num_pages=8, page_size=page_sizes[0], max_seq_len=16))  # fails early, in one line
    version = probe.version
    args = [(text, tuple(edits), seed, w, workers, seconds, max_cases, tuple(page_sizes)) for w in range(workers)]
    start = time.monotonic()
    if workers == 1:
        results = [_worker(args[0])]
    else:
        with mp.get_context("spawn").Pool(workers) as pool:
            results = pool.map(_worker, args)
    report = FuzzReport(seconds=time.monotonic() - start)
    out = Path(out_dir)
    for r in results:
        report.cases += r["cases"]
        report.ops += r["ops"]
        for name, n in r["events"].items():
            report.events[name] = report.events.get(name, 0) + n
        for kind, (case_seed, message, config, ops, detail) in r["findings"].items():
            if kind in report.findings:
                continue
            report.findings[kind] = (case_seed, message)
            safe = kind.replace(":", "-")
            path = out / f"{spec.name.replace(':', '-')}-{safe}-seed{case_seed}.jsonl"
            trace.write(path, header_for(spec, version, config, case_seed), ops)
            report.traces.append(path)
            small, small_config = minimize_finding(
                factory, config, ops, kind, page_sizes, budget=minimize_budget, max_replays=minimize_replays
            )
            small_path = path.with_suffix(".min.jsonl")
            trace.write(small_path, header_for(spec, version, small_config, None), small)
            report.traces.append(small_path)
            log.info(
                "%s: %s (seed %d, %d ops, minimized to %d: %s)",
                kind,
                message,
                case_seed,
                len(ops),
                len(small),
                small_path,
            )
            if detail:
                log.info("the subject's traceback:\n%s", detail)
    return report


def print_report(text: str, report: FuzzReport, workers: int) -> None:
    rate = report.ops / report.seconds if report.seconds else 0.0
    print(
        f"{text}: {report.cases} cases, {report.ops} operations in {report.seconds:.1f} s "
        f"({rate:,.0f} ops/s on {workers} worker{'s' if workers > 1 else ''})"
    )
    for kind, (seed, message) in sorted(report.findings.items()):
        print(f"FOUND [{kind}] {message} (case seed {seed})")
    for path in report.traces:
        print(f"  trace: {path}")
    if not report.findings:
        print("no finding")
