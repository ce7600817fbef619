"""`kvledger mutation` end to end on three mutants of one small function, and its equivalents file."""

from __future__ import annotations

import pytest

from kvledger.checker.audit import mutation

# the first three mutants of align_down (`return a - a % b`), by operator name: - becomes +, &, |
EQUIVALENTS = """\
# a comment, then one entry that matches (its mutated line holds " | " itself) and one stale
reference/pages.py:9 | core/ReplaceBinaryOperator_Sub_BitOr | return a | a % b | planted for the test
reference/pages.py:30 | core/NumberReplacer | return 7 | matches nothing
"""


def test_three_mutants_of_align_down_end_to_end(tmp_path, capsys):
    # the timeout only ends a hang (none of these mutants loops): generous, so load cannot turn a kill into one
    equivalents = tmp_path / "equivalents.txt"
    equivalents.write_text(EQUIVALENTS)
    code = mutation.run(
        only=["reference/pages.py::align_down"],
        limit=3,
        stages=["fuzz"],
        fuzz_cases=2,
        workers=1,
        equivalents=str(equivalents),
        timeout=3600,
        work_dir=str(tmp_path / "work"),
        results=str(tmp_path / "results"),
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "| reference/pages.py | 3 | 1 | 0 | 2 | 0 | 0 | 0 | 100.0% |" in out
    assert "killed by stage: fuzz 2" in out
    assert "1 reviewed equivalents matched, 1 stale entries" in out
    assert "stale equivalent (equivalents.txt:3, matches no mutant)" in out
    report = (tmp_path / "results" / "README.md").read_text()
    assert "| **total** | 3 | 1 | 0 | 2 | 0 | 0 | 0 | 100.0% |" in report


def test_equivalents_parse_and_reject_entries_without_a_reason():
    entries = mutation.Equivalent.parse(EQUIVALENTS)
    assert [(e.path, e.line, e.operator, e.mutated, e.reason) for e in entries] == [
        ("reference/pages.py", 9, "core/ReplaceBinaryOperator_Sub_BitOr", "return a | a % b", "planted for the test"),
        ("reference/pages.py", 30, "core/NumberReplacer", "return 7", "matches nothing"),
    ]
    with pytest.raises(ValueError, match=":1: expected"):
        mutation.Equivalent.parse("fast/table.py:3 | core/NumberReplacer | x = 1")


def test_annotations_are_spans_only_under_postponed_evaluation():
    source = "from __future__ import annotations\n\ndef f(a: int | None = 3) -> list[int]:\n    x: int = a | 1\n"
    spans = mutation.annotation_spans(source)
    assert mutation.in_annotation(spans, (3, 13))  # the | of `int | None`
    assert not mutation.in_annotation(spans, (3, 25))  # the default value 3
    assert not mutation.in_annotation(spans, (4, 15))  # the | of `a | 1`
    assert mutation.annotation_spans(source.split("\n", 1)[1]) == []  # evaluated at definition
