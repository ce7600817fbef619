"""The lockstep property run: reference and fast agree and the five invariants hold after every
step of every generated sequence; under the CI profile every rare branch is reached."""

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from properties.machine import EXPECTED_EVENTS, REACHED, LockstepMachine


def test_lockstep_machine_reaches_every_rare_branch():
    REACHED.clear()
    run_state_machine_as_test(LockstepMachine)
    if settings.default.max_examples < 1000:
        pytest.skip(f"profile runs {settings.default.max_examples} examples; coverage is asserted for ci/deep")
    missing = sorted(EXPECTED_EVENTS - REACHED)
    assert not missing, f"the property run never reached: {missing}"
