"""`kvledger check`: a target's Hypothesis property run, with a report of what it reached and when.

One command over a `Target` (`properties/target.py`): `properties/machines.py` says which machine
checks it, the events it should reach and its settings; reference against fast runs the lockstep
machine (a zoo bug of fast patched in while the target is active), a subject runs the judge-mode
machine. The run is derandomized under `ci`, so it reaches the same states on any machine.

The run stops at its first failing sequence and leaves one trace, written as this target records
it (`trace_header`, producer "kvledger check"), ready for `kvledger replay`. kvledger's minimizer
shrinks it (a subject's with a fresh subject per replay, also looking for a shorter case of the
same kind); only a lockstep property of the run (a preemption count, liveness), which no replay of
a trace judges, is shrunk by Hypothesis, in a second run.

`sequences_to_reach` runs a target without shrinking and counts, per seed, the sequence that first
reached each expected event and the one that first failed (the zoo's measure: counts, never time).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

from kvledger.checker import sandbox
from kvledger.engine.ledger import trace
from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import TraceLine, as_record
from kvledger.engine.ledger.trace import Header
from kvledger.properties.machine_base import Progress
from kvledger.properties.machines import Failure, machine_run
from kvledger.properties.profiles import register_profiles
from kvledger.properties.target import SubjectTarget, Target, config_of, header_of

log = logging.getLogger(__name__)

PRODUCER = "kvledger check"
Ops = Sequence[TraceLine]


def reach_report(expected: FrozenSet[str], reached: Dict[str, int]) -> str:
    """One line per expected rare event: whether the run reached it, and the number of the
    sequence (1 = the run's first) that reached it first."""
    lines = []
    for name in sorted(expected):
        first = reached.get(name)
        lines.append(f"  [{'x' if first else ' '}] {name}" + (f"  (sequence {first})" if first else ""))
    return "\n".join(lines)


def run_check(
    target: Target,
    profile: str = "ci",
    examples: Optional[int] = None,
    out_dir: str | Path = ".kvledger/failures",
    minimize_budget: float = 30.0,
) -> int:
    """Run `target`'s machine under `profile` (`examples` sequences instead of the profile's) and
    print what it reached, or its failure and the trace written under `out_dir`. Exit 0 when it
    passed, 1 on a failure, 2 when the target's bug is unknown. An isolated target's machine runs
    in a child process (`sandbox.py`): a subject that kills it is a failure like any other."""
    register_profiles(profile)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(target.active())
        except KeyError as e:  # a zoo bug fast does not have
            print(f"kvledger check: {e.args[0]}", file=sys.stderr)
            return 2
        start = time.perf_counter()
        try:
            outcome = sandbox.call(target.isolation, _run_machine, target, profile, examples)
        except sandbox.SubjectDied as died:
            outcome = _died(target, died)
        if outcome.failure is not None:
            failure = outcome.failure
            elapsed = time.perf_counter() - start
            if isinstance(target, SubjectTarget):
                header, ops, kind, lines = _minimized_subject(target, failure, minimize_budget)
            else:
                header, ops, kind, lines = _minimized_lockstep(target, failure, minimize_budget, profile, examples)
            path = Path(out_dir) / f"{_file_stem(target)}-{kind.replace(':', '-')}.jsonl"
            trace.write(path, target.trace_header(header, PRODUCER), ops)
            again = f"kvledger replay {path}" + (f" --bug {target.bug}" if target.bug else "")
            sequences = f"{outcome.sequences} sequences" if outcome.sequences else "its process died"
            print(f"FAILED after {elapsed:.1f}s ({sequences}): {lines[0]}")
            print(f"the failing trace, {len(ops)} operations: {path} ({again})")
            for op in ops:
                print("  " + json.dumps(op if isinstance(op, dict) else as_record(op).to_json()))
            print("\n".join(lines[1:]))
            return 1
    elapsed = time.perf_counter() - start
    reached = outcome.expected & outcome.reached.keys()
    print(
        f"{outcome.title}: passed in {elapsed:.1f}s, {outcome.sequences} sequences; rare events reached "
        f"({len(reached)}/{len(outcome.expected)}), with the sequence that first reached each:"
    )
    print(reach_report(outcome.expected, outcome.reached))
    return 0


@dataclass
class MachineOutcome:
    """What one run of a target's machine tells the command (from the child, when isolated): its
    title, the events it should reach and the sequence that first reached each, the sequences run
    (0: unknown, its process died) and its failure, if any."""

    title: str
    expected: FrozenSet[str]
    reached: Dict[str, int]
    sequences: int
    failure: Optional[Failure] = None


def _run_machine(target: Target, profile: str, examples: Optional[int]) -> MachineOutcome:
    run = machine_run(target, Progress(), profile, examples)
    log.info(
        "kvledger check %s: profile %s, %d sequences of up to %d operations",
        run.title,
        profile,
        run.settings.max_examples,
        run.settings.stateful_step_count,
    )
    failure = None
    try:
        run.run(shrink=False)
    except AssertionError:  # a Finding, or a property of the run (liveness, preemption counts)
        failure = run.failure()
        if failure is None:
            raise
    progress = run.progress
    return MachineOutcome(run.title, run.expected, dict(progress.reached), progress.sequences, failure)


def _died(target: Target, died: sandbox.SubjectDied) -> MachineOutcome:
    """The run whose process died: its failure is the death, on the sequence the record kept."""
    header = died.header or Header(num_pages=1, page_size=1, cache_type="radix", table_slots=1, max_seq_len=1)
    if isinstance(target, SubjectTarget):
        header = header_of(config_of(header), None, "hypothesis", target.name, target.version)
    return MachineOutcome(target.name, frozenset(), {}, 0, Failure(header, list(died.ops), died))


def _minimized_lockstep(
    target: Target, failure: Failure, budget: float, profile: str, examples: Optional[int]
) -> Tuple[Header, Ops, str, List[str]]:
    """Lockstep's failing trace to write (header, operations), its kind and the lines that describe
    it. A Finding replays as a trace, so kvledger's minimizer shrinks it (Hypothesis took minutes
    over the lockstep machine where delta debugging takes seconds); a property of the run (a
    preemption count, liveness) fails only under the machine, so the run is repeated with
    Hypothesis' shrinking, which replays the shrunk sequence last."""
    from kvledger.checker.minimize import MinimizeError, minimize
    from kvledger.properties.target import replay

    if isinstance(failure.error, Finding):
        try:
            header, ops, kind = minimize(failure.header, failure.ops, budget, target=target)
        except MinimizeError:
            return failure.header, failure.ops, failure.kind, _lines(failure.kind, failure.message, None)
        found, _ = replay(target, header, ops)
        message = found.message if found is not None else failure.message
        return header, ops, kind, _lines(kind, message, found.detail if found is not None else None)
    again = machine_run(target, Progress(), profile, examples)
    with contextlib.suppress(AssertionError):
        again.run()
    shrunk = again.failure() or failure
    return shrunk.header, shrunk.ops, shrunk.kind, _lines(shrunk.kind, shrunk.message, None)


def _minimized_subject(target: SubjectTarget, failure: Failure, budget: float) -> Tuple[Header, Ops, str, List[str]]:
    """A subject's failing trace minimized by kvledger's minimizer (a fresh subject per replay):
    half the budget on its operations, half on short cases of the same kind."""
    from kvledger.checker.minimize import minimize_ops, shortest_failure
    from kvledger.checker.subject_walk import case_runner

    config = config_of(failure.header)
    small, found = minimize_ops(target, config, failure.ops, failure.kind, budget=budget / 2)
    small, config, found = shortest_failure(
        target, failure.kind, small, config, found, target.page_sizes, budget=budget / 2, case_runner=case_runner
    )
    header = header_of(config, None, "hypothesis", target.name, target.version)
    if found is None:  # not reached: every accepted candidate fails as the first failure did
        return header, small, failure.kind, _lines(failure.kind, failure.message, None)
    return header, small, found.kind, _lines(found.kind, found.message, found.detail)


def _lines(kind: str, message: str, detail: Optional[str]) -> List[str]:
    return [f"[{kind}] {message}"] + ([detail.rstrip()] if detail else [])


def _file_stem(target: Target) -> str:
    """A subject's name without its path (`minisgl`, not `minisgl:/checkout`), or "lockstep"."""
    spec = getattr(target, "spec", None)
    return str(spec.name if spec is not None else target.name).replace(":", "-")


@dataclass
class Reach:
    """What one seeded run reached: `sequences` run, `first` (event -> the sequence that first
    reached it), `caught` (the sequence that first failed, or None) and the failure's text;
    `expected` the events the target's machine should reach."""

    seed: Optional[int]
    sequences: int
    expected: FrozenSet[str]
    first: Dict[str, int] = field(default_factory=dict)
    caught: Optional[int] = None
    failure: Optional[str] = None


def sequences_to_reach(
    target: Target, seeds: Sequence[Optional[int]], examples: Optional[int] = None, profile: str = "ci"
) -> List[Reach]:
    """For each seed (None: the profile's own, derandomized run), run `target`'s machine under
    `profile` without shrinking (with the target's bug, if any) and return what it reached.
    Counts only: the same seed gives the same numbers on any machine."""
    register_profiles(profile)
    rows = []
    with target.active():
        for s in seeds:
            run = machine_run(target, Progress(), profile, examples)
            caught, failure = None, None
            try:
                run.run(seed=s, shrink=False)
            except AssertionError as e:
                caught, failure = run.progress.sequences, str(e)
            rows.append(Reach(s, run.progress.sequences, run.expected, dict(run.progress.reached), caught, failure))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """python -m kvledger.checker.check [--seeds 0,1,2|ci] [--examples N] [--subject SPEC] [--bug NAME]:
    per seed, the sequence that first reached each expected event (or first failed, with --bug)."""
    import argparse

    from kvledger.checker.targets import target_for

    p = argparse.ArgumentParser(prog="python -m kvledger.checker.check", description=main.__doc__)
    p.add_argument("--seeds", default="ci", help="comma-separated seeds; 'ci' is the derandomized CI run")
    p.add_argument("--examples", type=int, default=None)
    p.add_argument("--subject", default=None, help="a subject spec (default: reference against fast)")
    p.add_argument("--bug", default=None, help="a zoo bug of fast, or of --subject")
    p.add_argument("--profile", default="ci")
    args = p.parse_args(argv)
    seeds = [None if x == "ci" else int(x) for x in args.seeds.split(",")]
    target = target_for(args.subject, bug=args.bug)
    for row in sequences_to_reach(target, seeds, args.examples, args.profile):
        name = "ci" if row.seed is None else row.seed
        if args.bug:
            found = f"caught at sequence {row.caught}" if row.caught else f"missed in {row.sequences} sequences"
            print(f"seed {name}: {args.bug} {found}")
            continue
        print(f"seed {name}: {row.sequences} sequences" + (f"; FAILED: {row.failure}" if row.failure else ""))
        for event_name in sorted(row.expected):
            print(f"  {row.first.get(event_name, '-')!s:>6}  {event_name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
