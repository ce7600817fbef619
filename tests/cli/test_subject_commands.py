"""The subject options of the command line: listing, one-line errors, replay and minimize of a
subject's trace named in its header."""

from __future__ import annotations

import pytest

from kvledger.cli import main
from kvledger.subjects import BUILTINS, SpecError, parse_spec
from tests.support.paths import SUBJECT_REGRESSIONS

REGRESSION = SUBJECT_REGRESSIONS / "minisgl-20fcd7f-cache-req-keeps-freed-pages.jsonl"


def test_subjects_lists_every_builtin(capsys):
    assert main(["subjects"]) == 0
    out = capsys.readouterr().out
    for name in BUILTINS:
        assert any(line.split()[:1] == [name] for line in out.splitlines()), name
    assert any(line.split()[:2] == ["fast", "yes"] for line in out.splitlines())  # columns widen with names


@pytest.mark.parametrize(
    "argv, words",
    [
        (["check", "--subject", "nosuch"], "unknown subject 'nosuch'"),
        (["check", "--subject", "vllm:/x"], "vllm takes no path"),
        (["fuzz", "--subject", "minisgl:/no/such/dir", "--seconds", "1"], "no such checkout or snapshot"),
        (["check", "--subject", "fast", "--bug", "nosuch"], "fast has no zoo bug 'nosuch'"),
        (["check", "--subject", "nosuch_module_xyz:build"], "cannot import nosuch_module_xyz"),
    ],
)
def test_a_bad_subject_is_one_line_and_exit_2(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err


def test_specs():
    assert parse_spec("minisgl:/a/b").path == "/a/b"
    assert parse_spec("pkg.mod:factory").name == "pkg.mod:factory"
    with pytest.raises(SpecError):
        parse_spec("")


def test_replay_and_minimize_follow_the_trace_header(tmp_path, capsys):
    if parse_spec("minisgl").adapter().probe(None)[0] is False:
        pytest.skip("mini-sglang is not available here")
    assert main(["replay", str(REGRESSION)]) == 1
    assert "FOUND at operation 3" in capsys.readouterr().out
    assert main(["replay", str(REGRESSION), "--fix", "pr142"]) == 0
    out = tmp_path / "small.jsonl"
    assert main(["minimize", str(REGRESSION), "-o", str(out), "--budget", "30", "--max-replays", "100"]) == 0
    assert out.exists() and "minimized 3 operations to" in capsys.readouterr().out
