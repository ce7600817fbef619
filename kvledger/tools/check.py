"""`kvledger check`: the lockstep property run, with a report of what it reached."""

from __future__ import annotations

import logging
import time

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvledger.properties.lockstep import Divergence
from kvledger.properties.machine import EXPECTED_EVENTS, REACHED, LockstepMachine, failures_dir

log = logging.getLogger(__name__)


def run_check(profile: str, examples: int | None = None) -> int:
    settings.load_profile(profile)
    chosen = settings(settings.default, max_examples=examples) if examples else settings.default
    log.info("kvledger check: profile %s, %d sequences of up to %d operations, reference vs fast in lockstep",
             profile, chosen.max_examples, chosen.stateful_step_count)
    REACHED.clear()
    start = time.perf_counter()
    try:
        run_state_machine_as_test(LockstepMachine, settings=chosen)
    except Divergence as e:
        print(f"FAILED after {time.perf_counter() - start:.1f}s: {e}")
        print(f"the shrunk failing trace: {failures_dir()}/hypothesis-last-failure.jsonl (kvledger replay it)")
        return 1
    elapsed = time.perf_counter() - start
    print(f"passed in {elapsed:.1f}s; rare branches reached ({len(REACHED & EXPECTED_EVENTS)}/{len(EXPECTED_EVENTS)}):")
    for name in sorted(EXPECTED_EVENTS):
        print(f"  [{'x' if name in REACHED else ' '}] {name}")
    return 0
