"""The lockstep property run: reference and fast agree, and the invariants hold, after every
step of every generated sequence (profile from $HYPOTHESIS_PROFILE, default `ci`)."""

from properties.machine import TestLockstep  # noqa: F401  (collected by pytest)
