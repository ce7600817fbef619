"""`kvledger replay --subject SPEC TRACE` (or a trace whose header names its subject): judge mode."""

from __future__ import annotations

import logging
import sys

from kvledger.checker.subject_fuzz import config_of
from kvledger.engine.ledger.trace import TraceError, read
from kvledger.properties.subject import SubjectUnavailable
from kvledger.properties.subject_driver import replay
from kvledger.subjects import SpecError, parse_spec

log = logging.getLogger(__name__)


def replay_subject_file(path: str, subject: str | None, fix: str | None = None, bug: str | None = None) -> int:
    """Exit 0 when the subject keeps every invariant, 1 on a finding, 2 on a bad trace or spec."""
    try:
        header, ops = read(path)
    except (OSError, TraceError) as e:
        print(f"kvledger replay: {e}", file=sys.stderr)
        return 2
    text = subject or header.subject
    try:
        spec = parse_spec(text)
        edits = edits_for(spec, fix=fix, bug=bug)
        factory = spec.factory(edits)
        config = config_of(header)
        version = factory(config).version
        if header.subject_version and spec.text == header.subject and version != header.subject_version:
            log.warning("%s was recorded on %s %s; replaying on %s", path, spec.text, header.subject_version, version)
        finding, applied = replay(factory, config, ops)
    except (SpecError, SubjectUnavailable, KeyError) as e:
        print(f"kvledger replay: {e}", file=sys.stderr)
        return 2
    if finding is not None:
        print(f"FOUND at operation {len(applied)} ({applied[-1].get('op')}): [{finding.kind}] {finding.message}")
        if finding.detail:
            print(finding.detail.rstrip())
        return 1
    print(
        f"OK: {len(applied)} of {len(ops)} operations applied on {text}; every invariant held "
        f"({len(ops) - len(applied)} refused as invalid at their point)"
    )
    return 0


def edits_for(spec, fix: str | None = None, bug: str | None = None):
    """The source edits a --fix (upstream-style fix) or --bug (the subject's zoo) names."""
    edits = []
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
