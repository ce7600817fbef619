"""kvledger's checker: the public API for putting a cache manager under kvledger's judge.

An adapter author imports everything from here:

    from kvledger.checker import CachedEntry, Capabilities, Subject, SubjectConfig, View

The protocol and the judge live in the checker's core (`kvledger.properties`); this package holds
the commands written over it (check, fuzz, minimize, replay, show, explore, zoo, campaigns) and,
under `audit/`, what measures the checker itself (zoo runs, mutation, coverage, benchmarks).
"""

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

__all__ = [
    "CachedEntry",
    "Capabilities",
    "DriverMismatch",
    "Subject",
    "SubjectConfig",
    "SubjectFactory",
    "SubjectUnavailable",
    "View",
    "judge",
]
