"""A subject that kills its process (SIGSEGV through ctypes, `os._exit`, a runaway allocation, a
hang no signal reaches) is a finding with a replayable minimized trace in every command, and the
checker's process survives it: the sandbox, the write-ahead record, and their use by check, fuzz
(one and two workers), explore, minimize, replay, a campaign and the pytest entry point."""

from __future__ import annotations

import os

import pytest

from kvledger.checker import sandbox
from kvledger.checker.fuzz import format_summary, fuzz
from kvledger.checker.replay import replay_trace
from kvledger.checker.targets import subject_target
from kvledger.cli import main
from kvledger.engine.ledger.ops import InvalidOp, Prefill, Submit, written
from kvledger.engine.ledger.trace import read
from kvledger.properties import write_ahead
from kvledger.properties.isolation import Isolation
from kvledger.properties.subject import SubjectConfig, header_of
from kvledger.properties.subject_calls import call_subject, describe
from kvledger.properties.target import SubjectTarget
from tests.support import dying_subject

SEGV = "tests.support.dying_subject:segv"
FAST = Isolation(memory_cap_mb=300, hang_limit_s=2.0)  # small enough that the deaths come quickly
CONFIG = SubjectConfig(num_pages=8, page_size=1, max_seq_len=16, max_running_req=4)
# the shortest sequence that kills a dying subject: two requests hold pages, one computes two
DEADLY = [
    written(Submit(0, (5,), 1)),
    written(Submit(1, (6, 7), 1)),
    written(Prefill(64, (1,))),
]


def _replay(factory, isolation=FAST):
    from kvledger.checker.isolated_runs import replay_isolated

    target = SubjectTarget(factory, "dying", isolation=isolation)
    return replay_isolated(target, header_of(CONFIG, None, "test", "dying", ""), DEADLY)


# -- the sandbox -------------------------------------------------------------------------------------
def test_a_call_returns_raises_and_relays_as_it_would_in_process():
    heard = []

    def work(x):
        sandbox.send(("half", x / 2))
        return os.getpid(), x * 2

    pid, value = sandbox.call(FAST, work, 21, on_message=heard.append)
    assert value == 42 and pid != os.getpid() and heard == [("half", 10.5)]
    assert sandbox.call(Isolation.off(), work, 1, on_message=heard.append)[0] == os.getpid()
    with pytest.raises(KeyError, match="boom") as raised:
        sandbox.call(FAST, lambda: {}["boom"])
    assert "raised in the sandbox's child" in "".join(raised.value.__notes__)


@pytest.mark.parametrize(
    "factory, kind, stack",
    [
        (dying_subject.segv, "subject-crashed:SIGSEGV", True),
        (dying_subject.exits, "subject-crashed:exit-3", False),  # os._exit leaves no stack behind
        (dying_subject.oom, "subject-oom", True),
        (dying_subject.hang, "subject-hung", True),
    ],
)
def test_each_death_is_a_finding_at_the_operation_in_flight_with_its_stack(factory, kind, stack):
    finding, applied = _replay(factory)
    assert finding is not None and finding.kind == kind
    assert finding.step == 3 and finding.op["op"] == "prefill"  # the operation in flight
    assert applied == DEADLY
    assert ("in die" in finding.detail or "line 4" in finding.detail) == stack  # the subject's own frame


def test_the_same_trace_on_the_sound_subject_replays_clean():
    finding, applied = _replay(dying_subject.DyingCache.__mro__[1])  # the toy cache, without the deadly line
    assert finding is None and applied == DEADLY


def test_a_memory_error_in_process_is_subject_oom_and_an_empty_assert_names_its_line():
    def hoard():
        raise MemoryError

    with pytest.raises(Exception) as caught:
        call_subject("computed", hoard)
    assert caught.value.kind == "subject-oom"

    def bare():
        raise AssertionError  # as a bare `assert` does outside pytest's rewriting: no message

    try:
        bare()
    except AssertionError as e:
        text = describe(e)
    assert text.startswith("AssertionError at ") and "test_isolation.py" in text and "raise AssertionError" in text


def test_the_record_holds_the_run_in_flight_and_its_copies_prior_operations(tmp_path):
    import copy

    from kvledger.properties.drivers import driver_for
    from tests.support.toy_block_subject import factory

    log = write_ahead.open_log(tmp_path / "record.jsonl")
    try:
        driver = driver_for(factory(CONFIG), CONFIG)
        driver.apply(DEADLY[0])
        twin = copy.deepcopy(driver)  # explore's copy of a run: its record starts with what it has
        twin.apply(DEADLY[1])
        header, ops = write_ahead.last_sequence(log.path)
        assert ops == DEADLY[:2] and header.num_pages == CONFIG.num_pages
        with pytest.raises(InvalidOp):
            driver.apply(written(Submit(0, (1,), 1)))  # uid 0 again: refused as invalid, never applied
        _, ops = write_ahead.last_sequence(log.path)
        assert ops == DEADLY[:1]
    finally:
        write_ahead.close()


# -- the commands: each death in each of them ------------------------------------------------------
DEATHS = [
    ("segv", "subject-crashed:SIGSEGV"),
    ("exits", "subject-crashed:exit-3"),
    ("oom", "subject-oom"),
    ("hang", "subject-hung"),
]
QUICK = Isolation(memory_cap_mb=300, hang_limit_s=1.0)
LIMITS = ["--memory-cap", "300", "--hang-limit", "1"]


def _replays(death):
    """The minimizer's replay bound: a hanging candidate costs the hang limit, so few of them."""
    return 6 if death == "hang" else 150


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("death, kind", DEATHS)
def test_fuzz_reports_each_death_with_a_minimized_trace_and_goes_on(tmp_path, workers, death, kind):
    spec = f"tests.support.dying_subject:{death}"
    result = fuzz(600, workers=workers, seed=0, out_dir=tmp_path, progress=False, max_cases=3,
                  target=subject_target(spec, isolation=QUICK), minimize_replays=_replays(death))  # fmt: skip
    (found,) = result.failures
    assert found.kind == kind and found.minimized_ops is not None and found.minimized_kind == kind
    # every worker went on after its child died and ran all its cases
    assert [(s.cases, s.reason) for s in result.stops] == [(3, "ran its 3 cases")] * workers
    assert not result.incomplete
    summary = format_summary(result)
    assert f"FOUND {kind}" in summary and "no finding" not in summary and "first finding to arrive: after" in summary
    if death != "exits":  # os._exit leaves no stack behind
        assert "the minimized trace's traceback" in summary and "in die" in found.minimized_traceback
    assert replay_trace(str(found.minimized_path), subject_target(spec, isolation=QUICK)) == 1
    header, ops = read(found.minimized_path)
    assert header.subject == spec and len(ops) == found.minimized_ops
    if death == "segv":  # a deterministic death minimizes to its 3 operations
        assert found.minimized_ops == 3


def test_a_worker_that_dies_in_process_is_a_finding_and_never_no_finding(tmp_path):
    target = subject_target(SEGV, isolation=Isolation.off())
    result = fuzz(600, workers=1, seed=0, out_dir=tmp_path, progress=False, max_cases=4, target=target,
                  minimize_replays=50)  # fmt: skip
    (stop,) = result.stops
    assert stop.early and "SIGSEGV" in stop.reason
    assert [f.kind for f in result.failures] == ["subject-crashed:SIGSEGV"]  # from the worker's own record
    summary = format_summary(result)
    assert "ENDED EARLY" in summary and "no finding" not in summary


@pytest.mark.parametrize("death, kind", DEATHS)
def test_check_reports_each_death_and_its_trace_replays_to_it(tmp_path, capsys, death, kind):
    from kvledger.checker.check import run_check

    spec = f"tests.support.dying_subject:{death}"
    # the minimizer's seconds only cut its search short: the kind is the verdict
    assert run_check(subject_target(spec, isolation=QUICK), out_dir=tmp_path, minimize_budget=2) == 1
    out = capsys.readouterr().out
    assert f"[{kind}]" in out
    # a MemoryError under the cap is caught where the subject raised it, and the run goes on to
    # report its sequences; the others take the process, and the Hypothesis run's counts with it
    assert ("its process died" in out) == (death != "oom")
    (path,) = tmp_path.glob("*.jsonl")
    assert main(["replay", str(path), *LIMITS]) == 1
    assert kind in capsys.readouterr().out


@pytest.mark.parametrize("death, kind", DEATHS)
def test_explore_reports_each_death_as_its_counterexample(tmp_path, capsys, death, kind):
    spec = f"tests.support.dying_subject:{death}"
    code = main(["explore", "--scope", "ci", "--subject", spec, "--out-dir", str(tmp_path), "-q", *LIMITS])
    out = capsys.readouterr().out
    assert code == 1 and kind in out
    (path,) = tmp_path.glob("*.jsonl")
    assert main(["replay", str(path), *LIMITS]) == 1
    assert kind in capsys.readouterr().out


@pytest.mark.parametrize("death, kind", DEATHS)
def test_a_campaign_task_whose_subject_dies_is_a_finding_not_a_lost_worker(tmp_path, capsys, death, kind):
    spec = f"tests.support.dying_subject:{death}"
    args = ["fuzz", "--subject", spec, "--tasks", "2", "--cases", "3", "--workers", "2", "-q", *LIMITS]
    assert main([*args, "--minimize-replays", str(_replays(death)), "--campaign", str(tmp_path / "c")]) == 1
    text = (tmp_path / "c" / "summary.txt").read_text()
    assert f"FINDING {kind} in task" in text and "minimized (" in text and "s into its task" in text
    (minimized,) = sorted((tmp_path / "c").glob("findings/*-min.jsonl"))
    capsys.readouterr()
    assert main(["replay", str(minimized), *LIMITS]) == 1
    assert kind in capsys.readouterr().out


def test_minimize_shrinks_a_hang_without_hanging(tmp_path, capsys):
    target = SubjectTarget(dying_subject.hang, "tests.support.dying_subject:hang", isolation=FAST)
    from kvledger.checker.minimize import minimize_ops

    padded = [DEADLY[0], written(Submit(2, (9, 9, 9), 1)), *DEADLY[1:]]
    small, finding = minimize_ops(target, CONFIG, padded, "subject-hung", budget=600, max_replays=8)
    assert finding is not None and finding.kind == "subject-hung" and len(small) == 3


def test_the_pytest_entry_point_fails_the_test_with_the_trace_and_survives(tmp_path):
    from kvledger.checker.testing import SubjectFinding, check_subject

    with pytest.raises(SubjectFinding) as caught:
        check_subject(dying_subject.segv, examples=0, fuzz_cases=3, out_dir=tmp_path)
    assert caught.value.kind == "subject-crashed:SIGSEGV" and 0 < len(caught.value.ops) <= 4
    # this process is alive to say so, and the trace it was handed replays to the same death
    assert replay_trace(str(caught.value.trace_path), subject_target(SEGV)) == 1
