"""The subject workload: how `kvledger fuzz --subject SPEC` chooses operations for one subject.

Each case draws a pool shape and prompt stems (`properties/subject_workload.py`), walks up to
`MAX_OPS` operations through the `SubjectDriver` (the judge after every one), then drains every
request to its end, where quiescence is judged, and liveness for a subject that preempts
(`subject_workload.drain_steps`); the driver judges each refusal at the admission itself
(4-failed-admission). Worker w of `workers` runs case seeds `seed * 1_000_003 + w + k * workers`.
A finding is minimized by delta debugging over the operations, then by a search of short cases for
the same kind (`checker/minimize.py`'s `minimize_ops` and `shortest_failure`).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from kvledger.engine.ledger.ops import InvalidOp, OpRecord, OpResult
from kvledger.engine.ledger.trace import Header
from kvledger.properties.isolation import IN_PROCESS, Isolation
from kvledger.properties.subject import Subject, SubjectConfig
from kvledger.properties.subject_workload import DRAIN_LIMIT, drain_steps, draw_shape, next_op, stalled_after
from kvledger.properties.target import SubjectRun, SubjectTarget, config_of, header_of

MAX_OPS = 40  # operations of a case before its drain
Op = Dict[str, Any]


def walk(
    run: SubjectRun, rng: random.Random, shape: Any, keep_going: Callable[[], bool], max_ops: int
) -> Iterator[None]:
    """`max_ops` operations chosen from the driver's state (an operation the driver refuses as
    invalid is skipped and never recorded), then the drain; one recorded operation per iteration."""
    driver = run.driver

    def apply(op: Op) -> Optional[OpResult]:
        try:
            return run.apply(op)
        except InvalidOp:  # never recorded: the trace keeps valid operations only
            return None

    history: List[List[int]] = []
    uid = stalled = 0
    for _ in range(max_ops):
        if not keep_going():
            return
        op = next_op(rng, shape, driver, uid, history)
        out = None if op is None else apply(op)
        if op is None or out is None:
            continue
        uid += op["op"] == "submit"
        stalled = stalled_after(stalled, op, out)
        yield
    yield from drain_steps(driver, apply, DRAIN_LIMIT, stalled)


class SubjectWorkload:
    """One subject in judge mode as the fuzzer walks it: short cases, the first finding of each
    kind kept (a subject's cases are cheap and each kind is another bug)."""

    producer = "kvledger fuzz --subject"
    stops_at_first = False
    zoo_cases = 2000
    zoo_minimize = (15.0, 400)  # a subject's replays cost milliseconds

    def __init__(self, target: SubjectTarget, max_ops: int = MAX_OPS) -> None:
        self.target = target
        self.max_ops = max_ops
        self.expected: Set[str] = set()

    def prepare(self) -> None:
        """Build the subject once: an adapter that fails does so in one line, and the subject's
        version is known for the traces' headers."""
        from kvledger.properties.subject_events import expected_events

        sample = self.target.subject(SubjectConfig(num_pages=8, page_size=self.target.page_sizes[0], max_seq_len=16))
        self.expected = set(expected_events(sample.capabilities, len(sample.view().groups)))
        self.expected |= getattr(sample, "rare_events", set())  # a subject's own (sglang:overlap's)

    def case_seed(self, seed: int, worker: int, workers: int, case: int) -> int:
        return seed * 1_000_003 + worker + case * workers

    def task_seed(self, seed: int, shard: int, case: int) -> int:
        from kvledger.checker.lockstep_walk import case_seed

        return case_seed(seed, shard, case) % (1 << 62)

    def _shape(self, cseed: int) -> Tuple[random.Random, Any]:
        rng = random.Random(cseed)
        return rng, draw_shape(rng, self.target.page_sizes)

    def header(self, cseed: int) -> Header:
        _, shape = self._shape(cseed)
        return header_of(shape.config, cseed, self.producer, self.target.name, self.target.version)

    def start(self, header: Header, note: Callable[[str], None]) -> SubjectRun:
        return self.target.start_config(config_of(header), on_event=note)

    def walk(self, run: Any, cseed: int, note: Callable[[str], None], keep_going: Callable[[], bool]) -> Iterator[None]:
        rng, shape = self._shape(cseed)  # the same stream the case's shape was drawn from
        return walk(run, rng, shape, keep_going, self.max_ops)

    def preemptions(self, run: Any) -> int:
        return 0  # the driver keeps who is preempted now, not how often

    def expected_events(self) -> Set[str]:
        """The rare states the subject's capabilities make reachable (known once `prepare` ran)."""
        return set(self.expected)

    def trace_paths(self, out_dir: Path, seed: int, worker: int, case: int, cseed: int, kind: str) -> Tuple[Path, Path]:
        spec = getattr(self.target, "spec", None)
        name = (spec.name if spec is not None else self.target.name).replace(":", "-")
        path = out_dir / f"{name}-{kind.replace(':', '-')}-seed{cseed}.jsonl"
        return path, path.with_suffix(".min.jsonl")

    def minimizes(self, kind: str) -> bool:
        return kind not in ("crash", "hang")

    def minimize(
        self, header: Header, ops: List[OpRecord], kind: str, budget: float, replays: Optional[int], log: Any
    ) -> Tuple[Header, List[OpRecord], str]:
        """Delta debugging over the operations (half the budget), then short cases of the same kind."""
        from kvledger.checker.minimize import minimize_ops, shortest_failure

        config = config_of(header)
        small, finding = minimize_ops(self.target, config, ops, kind, budget=budget / 2, max_replays=replays)
        small, small_config, _ = shortest_failure(
            self.target,
            kind,
            small,
            config,
            finding,
            self.target.page_sizes,
            budget=budget / 2,
            case_runner=case_runner,
            max_replays=replays,
        )
        small_header = header_of(small_config, None, self.producer, self.target.name, self.target.version)
        return small_header, small, kind

    def replay_hint(self) -> str:
        extra = "".join(f" --{k} {v}" for k, v in (("fix", self.target.fix), ("bug", self.target.bug)) if v)
        return f"  (on the subject with{extra}: kvledger replay TRACE{extra})" if extra else ""


def run_case(
    factory: Callable[[SubjectConfig], Subject],
    seed: int,
    page_sizes: Sequence[int] = (1, 2, 4),
    max_ops: int = MAX_OPS,
    isolation: Isolation = IN_PROCESS,
) -> Any:
    """Case `seed` on a subject built by `factory` (the fuzzer's case, for tests): a `CaseOutcome`
    with its config, operations and finding; under `isolation` in a child, whose death is the
    case's finding."""
    with case_runner(factory, page_sizes, max_ops, isolation) as cases:
        return cases(0, seed)


def case_runner(
    factory: Callable[[SubjectConfig], Subject],
    page_sizes: Sequence[int] = (1, 2, 4),
    max_ops: int = MAX_OPS,
    isolation: Isolation = IN_PROCESS,
) -> Any:
    """The fuzzer's cases on a subject built by `factory` (the minimizer's search of short cases):
    a context manager whose value plays case (number, seed), all in one child under `isolation`."""
    from kvledger.checker.isolated_runs import Cases

    target = SubjectTarget(factory, "subject", page_sizes=page_sizes, isolation=isolation)
    return Cases(SubjectWorkload(target, max_ops), isolation)
