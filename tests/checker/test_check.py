"""`kvledger check` is one command over a Target: the lockstep machine for reference against fast
(with a zoo bug of fast planted when the target has one), the judge-mode machine for a subject;
a failure leaves one minimized trace that says it came from `kvledger check`."""

import pytest

from kvledger.checker.check import run_check, sequences_to_reach
from kvledger.checker.replay import replay_trace
from kvledger.checker.targets import lockstep_target, subject_target
from kvledger.cli import main
from kvledger.engine.ledger.trace import read
from kvledger.properties.subject import SubjectConfig, SubjectUnavailable

NANO_BUG = "nanovllm-free-keeps-used"  # caught at the CI run's second sequence


def _nanovllm(bug=None):
    try:
        target = subject_target("nanovllm", bug=bug)
        target.subject(SubjectConfig(num_pages=8, page_size=2, max_seq_len=16))
    except SubjectUnavailable as e:
        pytest.skip(str(e))
    return target


def test_a_lockstep_check_plants_the_bug_and_writes_a_trace_that_fails_only_with_it(tmp_path, capsys):
    assert run_check(lockstep_target("evict-counts-pages"), "ci", 40, tmp_path) == 1
    (path,) = tmp_path.glob("lockstep-*.jsonl")
    header, ops = read(path)
    assert header.producer == "kvledger check" and header.subject is None
    assert f"kvledger replay {path} --bug evict-counts-pages" in capsys.readouterr().out
    assert replay_trace(str(path), lockstep_target("evict-counts-pages")) == 1
    assert replay_trace(str(path), lockstep_target()) == 0  # fast as it is: the bug is what fails


def test_an_unknown_bug_of_fast_is_refused(tmp_path, capsys):
    assert run_check(lockstep_target("no-such-bug"), "dev", 2, tmp_path) == 2
    assert "unknown bug 'no-such-bug'" in capsys.readouterr().err


def test_a_subject_check_writes_its_minimized_trace_as_kvledger_check(tmp_path):
    target = _nanovllm(NANO_BUG)
    assert run_check(target, "ci", 40, tmp_path) == 1
    header, ops = read(tmp_path / "nanovllm-9-counters.jsonl")
    assert (header.producer, header.subject) == ("kvledger check", "nanovllm")
    assert [line.to_json() for line in ops] == [
        {"op": "submit", "uid": 0, "tokens": [0], "max_tokens": 1},
        {"op": "prefill", "budget": 64, "sample": [1]},
    ]


def test_sequences_to_reach_counts_a_subject_and_a_lockstep_target_alike():
    (subject,) = sequences_to_reach(_nanovllm(NANO_BUG), [None], 40)
    assert subject.caught == 2 and "9-counters" in (subject.failure or "")
    (lockstep,) = sequences_to_reach(lockstep_target(), [None], 5)
    assert lockstep.caught is None and lockstep.sequences >= 5
    assert "driver: idle" in lockstep.expected and lockstep.first["driver: idle"] == 1


def test_a_campaign_runs_fast_as_it_is_and_says_so_for_a_subject(capsys):
    assert main(["check", "--subject", "fast", "--tasks", "2"]) == 2
    assert "--tasks runs the lockstep machine on fast as it is" in capsys.readouterr().err
