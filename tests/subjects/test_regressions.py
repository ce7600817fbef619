"""The subjects' regression corpus: each minimized trace in tests/regressions/subjects must still
be a finding of its kind on the build that has the bug, and replay clean where the bug is fixed
(the next commit, or a copy with the upstream-style fix). Add one with
`kvledger check --subject SPEC` or `kvledger minimize` and an entry here."""

from __future__ import annotations

import pytest

from kvledger.checker.targets import subject_target
from kvledger.engine.ledger.trace import read
from kvledger.properties.subject import SubjectUnavailable
from kvledger.properties.target import replay
from tests.support.paths import SUBJECT_REGRESSIONS

CORPUS = SUBJECT_REGRESSIONS

# trace -> [(spec, fix or None, the finding's kind, or None for a clean replay)]
EXPECTED = {
    "minisgl-20fcd7f-cache-req-keeps-freed-pages": [
        ("minisgl", None, "1-2-partition"),
        ("minisgl", "pr142", None),
        ("fast", None, None),
    ],
    "nanovllm-f64d821-hit-on-free-block-loses-hash": [
        ("nanovllm@f64d821", None, "7-kv-provenance"),
        ("nanovllm@f64d821", "nanovllm-f64d821-hit-resets-free-block", None),
        ("nanovllm@bb823b3", None, None),
    ],
}


def test_every_trace_has_its_expectations():
    assert {p.stem for p in CORPUS.glob("*.jsonl")} == set(EXPECTED)


@pytest.mark.parametrize("name, spec, fix, kind", [(n, *row) for n, rows in sorted(EXPECTED.items()) for row in rows])
def test_replays_as_expected(name, spec, fix, kind):
    header, ops = read(CORPUS / f"{name}.jsonl")
    try:
        finding, _ = replay(subject_target(spec, fix=fix), header, ops)
    except SubjectUnavailable as e:
        pytest.skip(str(e))
    assert (finding.kind if finding else None) == kind, finding
