"""Building a `Target` (`properties/target.py`) from what a user names: reference against fast,
optionally with a zoo bug of fast, or a subject spec with the source edits of a --fix or a --bug.

The CLI builds one target per command from (--subject, --fix, --bug) and hands it to the command;
a trace whose header names a subject is replayed on that subject unless --subject says otherwise.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence, Tuple, Union

from kvledger.properties.isolation import IN_PROCESS, ISOLATED, Isolation
from kvledger.properties.target import LockstepTarget, SubjectTarget
from kvledger.subjects import SubjectSpec, parse_spec
from kvledger.subjects.edits import SourceEdit
from kvledger.subjects.fast_zoo import SPECULATION_BUGS, patched

AnyTarget = Union[LockstepTarget, SubjectTarget]


def lockstep_target(
    bug: Optional[str] = None, device: str = "cpu", speculate: bool = False, isolation: Isolation = IN_PROCESS
) -> LockstepTarget:
    """Reference against fast; `bug` names a zoo bug of fast (an unknown one is a KeyError naming
    the known ones once the target is `active`); `speculate`: speculating runs (a bug of fast's
    speculation always runs them); `isolation`: off unless asked (kvledger's own managers)."""
    return LockstepTarget(
        bug, device, patch=patched, speculate=speculate or bug in SPECULATION_BUGS, isolation=isolation
    )


class SpecTarget(SubjectTarget):
    """A subject target built from a spec, which it keeps (its zoo, fixes and page sizes)."""

    def __init__(
        self,
        spec: SubjectSpec,
        edits: Sequence[SourceEdit],
        fix: Optional[str],
        bug: Optional[str],
        isolation: Isolation = ISOLATED,
    ) -> None:
        super().__init__(
            spec.factory(edits), spec.text, bug=bug, fix=fix, page_sizes=spec.page_sizes(), isolation=isolation
        )
        self.spec = spec
        self.edits = tuple(edits)


def subject_target(
    text: str,
    fix: Optional[str] = None,
    bug: Optional[str] = None,
    edits: Optional[Sequence[SourceEdit]] = None,
    isolation: Isolation = ISOLATED,
) -> SpecTarget:
    """The subject `text` names (SpecError), with the edits of `fix` and `bug` (KeyError naming the
    known ones) or the given `edits`; isolated in a child process unless `isolation` says not."""
    spec = parse_spec(text)
    return SpecTarget(spec, edits_for(spec, fix=fix, bug=bug) if edits is None else edits, fix, bug, isolation)


def target_for(
    subject: Optional[str],
    fix: Optional[str] = None,
    bug: Optional[str] = None,
    device: str = "cpu",
    named: Optional[str] = None,
    speculate: bool = False,
    isolation: Isolation = ISOLATED,
    isolate: Optional[bool] = None,
) -> AnyTarget:
    """The target a command runs on: --subject, else the subject a trace's header names (`named`),
    else reference against fast; its runs under `isolation`'s limits, isolated as `isolate` says
    (None: each kind's default, a subject isolated and lockstep, kvledger's own code, not)."""
    text = subject or named
    if text:
        return subject_target(text, fix=fix, bug=bug, isolation=replace(isolation, enabled=isolate is not False))
    return lockstep_target(bug, device, speculate, replace(isolation, enabled=isolate is True))


def edits_for(spec: SubjectSpec, fix: Optional[str] = None, bug: Optional[str] = None) -> Tuple[SourceEdit, ...]:
    """The source edits a --fix (upstream-style fix) or --bug (the subject's zoo) names."""
    edits: list[SourceEdit] = []
    if fix:
        fixes = spec.fixes()
        if fix not in fixes:
            raise KeyError(f"{spec.name} has no fix {fix!r} (known: {', '.join(fixes) or 'none'})")
        edits += list(fixes[fix])
    if bug:
        zoo = {e.name: e for e in spec.zoo()}
        if bug not in zoo:
            raise KeyError(f"{spec.name} has no zoo bug {bug!r} (known: {', '.join(zoo) or 'none'})")
        edits.append(zoo[bug])
    return tuple(edits)
