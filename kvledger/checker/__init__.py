"""kvledger's checker: the public API for putting a cache manager under kvledger's judge.

An adapter author imports everything from here:

    from kvledger.checker import CachedEntry, Capabilities, Subject, SubjectConfig, View

and a project's tests check it with `check_subject` (failing with a `SubjectFinding`), or with the
`kvledger_check` fixture of kvledger's pytest plugin (`kvledger.checker.pytest_plugin`).

The protocol and the judge live in the checker's core (`kvledger.properties`); this package holds
the commands written over it (check, fuzz, minimize, replay, show, explore, zoo, campaigns) and,
under `audit/`, what measures the checker itself (zoo runs, mutation, coverage, benchmarks).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvledger.checker.testing import SubjectFinding, check_subject
    from kvledger.properties.subject import (
        CachedEntry,
        Capabilities,
        DriverMismatch,
        Subject,
        SubjectConfig,
        SubjectFactory,
        SubjectUnavailable,
        View,
    )
    from kvledger.properties.subject_judge import judge

# The names load on first use (PEP 562), so a command that only reaches a module of this package
# (the CLI's parser reads kvledger.checker.audit.mutation's defaults) does not import the judge and numpy.
_HOMES = {
    "CachedEntry": "kvledger.properties.subject",
    "Capabilities": "kvledger.properties.subject",
    "DriverMismatch": "kvledger.properties.subject",
    "Subject": "kvledger.properties.subject",
    "SubjectConfig": "kvledger.properties.subject",
    "SubjectFactory": "kvledger.properties.subject",
    "SubjectUnavailable": "kvledger.properties.subject",
    "View": "kvledger.properties.subject",
    "judge": "kvledger.properties.subject_judge",
    "check_subject": "kvledger.checker.testing",
    "SubjectFinding": "kvledger.checker.testing",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'kvledger.checker' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


__all__ = [
    "CachedEntry",
    "Capabilities",
    "DriverMismatch",
    "Subject",
    "SubjectConfig",
    "SubjectFactory",
    "SubjectFinding",
    "SubjectUnavailable",
    "View",
    "check_subject",
    "judge",
]
