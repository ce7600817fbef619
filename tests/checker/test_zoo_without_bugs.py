"""`kvledger zoo` on a user's subject, which plants no bugs: a clear message and exit 2, never
`caught 0 of 0` (issue 35, item 11)."""

from __future__ import annotations

from kvledger.cli import main
from tests.support.paths import SUPPORT


def test_zoo_on_a_subject_without_planted_bugs_says_so(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(SUPPORT))  # the subject is named by module: toy_block_subject:leaky
    code = main(["zoo", "--subject", "toy_block_subject:leaky"])
    captured = capsys.readouterr()
    assert code == 2
    assert "toy_block_subject:leaky has no planted bugs" in captured.err
    assert "Planting bugs in your subject" in captured.err
    assert "caught" not in captured.out
