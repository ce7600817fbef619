"""`kvledger check`: the lockstep property run, with a report of what it reached and when."""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Sequence

from hypothesis import settings

from kvledger.properties.machine import EXPECTED_EVENTS, Progress, failures_dir, run_machine
from kvledger.properties.profiles import register_profiles

log = logging.getLogger(__name__)


def reach_report(progress: Progress) -> str:
    """One line per expected rare event: whether the run reached it, and the number of the
    sequence (1 = the run's first) that reached it first."""
    lines = []
    for name in sorted(EXPECTED_EVENTS):
        first = progress.reached.get(name)
        mark = "x" if name in progress.reached else " "
        lines.append(f"  [{mark}] {name}" + (f"  (sequence {first})" if first else ""))
    return "\n".join(lines)


def run_check(profile: str, examples: int | None = None) -> int:
    register_profiles(profile)
    chosen = settings(settings.default, max_examples=examples) if examples else settings.default
    log.info(
        "kvledger check: profile %s, %d sequences of up to %d operations, reference vs fast in lockstep",
        profile,
        chosen.max_examples,
        chosen.stateful_step_count,
    )
    progress = Progress()
    start = time.perf_counter()
    try:
        run_machine(chosen, progress)
    except AssertionError as e:  # a Divergence, or a property of the run (liveness, preemption counts)
        print(f"FAILED after {time.perf_counter() - start:.1f}s: {e}")
        print(f"the shrunk failing trace: {failures_dir()}/hypothesis-last-failure.jsonl (kvledger replay it)")
        return 1
    elapsed = time.perf_counter() - start
    print(
        f"passed in {elapsed:.1f}s, {progress.sequences} sequences; rare branches reached "
        f"({len(EXPECTED_EVENTS & progress.reached.keys())}/{len(EXPECTED_EVENTS)}), "
        "with the sequence that first reached each:"
    )
    print(reach_report(progress))
    return 0


def sequences_to_reach(
    seeds: Sequence[int | None], examples: int | None = None, bug: str | None = None, profile: str = "ci"
) -> List[Dict]:
    """For each seed (None: the profile's own, derandomized run), run `profile` without shrinking
    (under zoo bug `bug`, if given) and return what it reached: {"seed", "sequences" (run),
    "first" (event -> the sequence that first reached it), "caught" (the sequence that first
    failed, or None)}. Counts only: the same seed gives the same numbers on any machine."""
    from hypothesis import Phase

    from kvledger.subjects.fast_zoo import patched

    register_profiles(profile)
    base = settings(settings.default, max_examples=examples) if examples else settings.default
    chosen = settings(base, phases=[p for p in base.phases if p is not Phase.shrink])
    rows = []
    for s in seeds:
        progress = Progress()
        caught, failure = None, None
        try:
            with patched(bug):
                run_machine(chosen, progress, seed=s)
        except AssertionError as e:
            caught, failure = progress.sequences, str(e)
        rows.append(
            {
                "seed": s,
                "sequences": progress.sequences,
                "first": dict(progress.reached),
                "caught": caught,
                "failure": failure,
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """python -m kvledger.checker.check [--seeds 0,1,2|ci] [--examples N] [--bug NAME] [--events a;b]:
    per seed, the sequence that first reached each expected event (or first failed, with --bug)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvledger.checker.check", description=main.__doc__)
    p.add_argument("--seeds", default="ci", help="comma-separated seeds; 'ci' is the derandomized CI run")
    p.add_argument("--examples", type=int, default=None)
    p.add_argument("--bug", default=None)
    p.add_argument("--profile", default="ci")
    args = p.parse_args(argv)
    seeds = [None if x == "ci" else int(x) for x in args.seeds.split(",")]
    for row in sequences_to_reach(seeds, args.examples, args.bug, args.profile):
        name = "ci" if row["seed"] is None else row["seed"]
        if args.bug:
            print(
                f"seed {name}: {args.bug} "
                + (
                    f"caught at sequence {row['caught']}"
                    if row["caught"]
                    else f"missed in {row['sequences']} sequences"
                )
            )
            continue
        print(f"seed {name}: {row['sequences']} sequences" + (f"; FAILED: {row['failure']}" if row["failure"] else ""))
        for event_name in sorted(EXPECTED_EVENTS):
            print(f"  {row['first'].get(event_name, '-')!s:>6}  {event_name}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
