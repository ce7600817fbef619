"""`kvledger check --subject SPEC`: the judge-mode Hypothesis run over one subject.

The profile sets the number of sequences (`SUBJECT_EXAMPLES`) and their length; the run is
derandomized under `ci`, so it reaches the same states on any machine. The first failing
sequence is minimized by kvledger's minimizer (a fresh subject per replay; Hypothesis's own
shrinking is off: over a real subject it took minutes where delta debugging takes seconds) and
written as a trace named after the subject and the finding, ready for `kvledger replay`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings

from kvledger.checker.targets import SpecTarget
from kvledger.engine.ledger import trace
from kvledger.properties.profiles import register_profiles
from kvledger.properties.subject import SubjectConfig
from kvledger.properties.subject_driver import expected_events
from kvledger.properties.subject_machine import SUBJECT_EXAMPLES, SUBJECT_STEPS, Progress, machine_for
from kvledger.properties.target import header_of

log = logging.getLogger(__name__)


def run_subject_check(
    target: SpecTarget,
    profile: str = "ci",
    examples: int | None = None,
    out_dir: str | Path = ".kvledger/failures",
    minimize_budget: float = 30.0,
    quiet: bool = False,
) -> tuple[int, Progress, Path | None]:
    """(exit code, what the run reached, the minimized failing trace or None)."""
    from kvledger.checker.minimize import minimize_ops, shortest_failure
    from kvledger.checker.subject_fuzz import run_case

    spec, text = target.spec, target.name
    factory = target.factory
    page_sizes = target.page_sizes
    sample = factory(SubjectConfig(num_pages=8, page_size=page_sizes[0], max_seq_len=16))
    version, expected = sample.version, expected_events(sample.capabilities)
    register_profiles(profile)
    chosen = settings(
        settings.default,
        max_examples=examples or SUBJECT_EXAMPLES[profile],
        stateful_step_count=SUBJECT_STEPS[profile],
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
        report_multiple_bugs=False,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
    )
    progress = Progress()
    machine = machine_for(factory, progress, page_sizes)
    log.info(
        "kvledger check --subject %s (%s): profile %s, %d sequences of up to %d operations, judge mode",
        text,
        version,
        profile,
        chosen.max_examples,
        chosen.stateful_step_count,
    )
    start = time.perf_counter()
    try:
        case = machine.TestCase
        case.settings = chosen
        case("runTest").runTest()
    except AssertionError as e:
        elapsed = time.perf_counter() - start
        if progress.last_failure is None:
            raise
        config, ops, first = progress.last_failure
        small, found = minimize_ops(target, config, ops, first.kind, budget=minimize_budget / 2)
        small, config, found = shortest_failure(
            target, first.kind, small, config, found, page_sizes, budget=minimize_budget / 2, run_case=run_case
        )
        finding = found or first  # every accepted candidate fails as the first failure did
        path = Path(out_dir) / f"{spec.name.replace(':', '-')}-{finding.kind.replace(':', '-')}.jsonl"
        trace.write(path, header_of(config, None, "kvledger fuzz --subject", text, version), small)
        if not quiet:
            print(f"FAILED after {elapsed:.1f}s ({progress.sequences} sequences): [{finding.kind}] {finding.message}")
            print(f"minimized to {len(small)} operations: {path} (kvledger replay {path})")
            for op in small:
                print("  " + json.dumps(op))
            if finding.detail:
                print(finding.detail.rstrip())
        del e
        return 1, progress, path
    elapsed = time.perf_counter() - start
    if not quiet:
        print(
            f"{text} ({version}): passed in {elapsed:.1f}s, {progress.sequences} sequences; rare states reached "
            f"({len(set(progress.reached) & expected)}/{len(expected)}), with the first sequence "
            "that reached each:"
        )
        for name in sorted(expected):
            seq = progress.reached.get(name)
            print(f"  [{'x' if seq else ' '}] {name}" + (f"  (sequence {seq})" if seq else ""))
    return 0, progress, None
