"""`kvledger explore`'s rough edges (issue 35, items 9 and 10): a scope that admits nothing is
warned about, a counterexample of a build with a bug is named after the bug, and a search cut by a
limit or a signal reports what it explored, marked partial."""

from __future__ import annotations

import os
import signal
import threading

from kvledger.checker.explore import explore, format_result
from kvledger.checker.explore_scope import SCOPES
from kvledger.cli import main


def test_a_scope_that_admits_nothing_is_warned_about(capsys):
    code = main(["explore", "--pages", "1", "--page-size", "1", "--prompts", "0,0", "--max-tokens", "1"])
    captured = capsys.readouterr()
    assert code == 0 and "exhausted" in captured.out
    said = "no request can ever be admitted: the smallest, prompt [0, 0] with max_tokens 1, needs 2 pages"
    assert f"WARNING: {said}" in captured.out and said in captured.err


def test_a_scope_that_admits_is_not_warned_about():
    assert SCOPES["ci"].never_admits() is None
    assert "WARNING" not in format_result(explore(SCOPES["small"], progress=False))


def test_a_counterexample_of_a_subjects_bug_is_named_after_it(tmp_path):
    from kvledger.checker.targets import subject_target

    bug = "nanovllm-deallocate-skips-first"
    target = subject_target("nanovllm", bug=bug)
    result = explore(SCOPES["bug-paged"].with_(max_depth=3), target=target, out_dir=tmp_path, progress=False)
    assert result.findings
    written = result.findings[0].trace_path
    assert written is not None and f"-{bug}-" in written.name and "-clean-" not in written.name
    assert f"--bug {bug}" in format_result(result)
    assert main(["replay", str(written), "--bug", bug]) == 1


def test_a_state_cap_leaves_a_partial_report(capsys):
    code = main(["explore", "--scope", "ci", "--max-states", "20"])
    out = capsys.readouterr().out
    assert code == 0
    assert "cut (states): PARTIAL, not exhausted (20 states explored, depth" in out
    assert "no divergence up to the cut" in out and "exhausted" not in out.replace("not exhausted", "")


def test_sigterm_stops_the_search_with_a_partial_report(capsys):
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        code = main(["explore", "--scope", "large"])
    finally:
        timer.cancel()
    out = capsys.readouterr().out
    assert code == 0 and "cut (interrupted): PARTIAL, not exhausted" in out
