"""The Hypothesis profiles of the property run, registered on request, never at import.

`register_profiles()` registers `ci`, `deep` and `dev` and loads one: the argument, else
$HYPOTHESIS_PROFILE, else `ci`. tests/conftest.py calls it, and so does every tool that runs the
state machine (`kvledger check`, `coverage`, `zoo`): importing `properties.machine` changes no
Hypothesis setting of the importing process.
"""

from __future__ import annotations

import os
from typing import Any, Dict

from hypothesis import settings

PROFILES: Dict[str, Dict[str, Any]] = {
    # derandomized (Hypothesis then keeps no example database); failures are kept as traces.
    # max_examples counts valid sequences: Hypothesis discards one in which no rule is enabled or
    # whose draws overrun its buffer, and a run's "N sequences" counts those too. Judge mode
    # (--subject) replaces the count and step count with subject_machine.SUBJECT_EXAMPLES/_STEPS.
    "ci": dict(derandomize=True, max_examples=1500, stateful_step_count=60, deadline=None, print_blob=True),
    "deep": dict(max_examples=5000, stateful_step_count=120, deadline=None),
    "dev": dict(max_examples=40, stateful_step_count=30, deadline=None),
}
DEFAULT = "ci"


def register_profiles(load: str | None = None) -> str:
    """Register every profile; load `load` (else $HYPOTHESIS_PROFILE, else ci). Returns its name."""
    for name, options in PROFILES.items():
        settings.register_profile(name, **options)
    name = load or os.environ.get("HYPOTHESIS_PROFILE") or DEFAULT
    settings.load_profile(name)
    return name
