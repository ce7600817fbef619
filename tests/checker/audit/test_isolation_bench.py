"""The isolation benchmark plays the same cases both ways and measures the record and a fork."""

from kvledger.checker.audit import isolation_bench
from kvledger.checker.targets import subject_target

TOY = "tests.support.toy_block_subject:factory"


def test_the_same_cases_run_in_process_and_isolated_and_each_rate_is_measured():
    rates = isolation_bench.rounds(subject_target(TOY), cases=2, n=2)
    assert set(rates) == {"in process", "isolated"} and all(len(r) == 2 and min(r) > 0 for r in rates.values())
    cost = isolation_bench.record_cost(calls=200)
    assert cost["open"] > 0 and cost["closed"] > 0


def test_the_command_prints_both_modes_the_record_and_a_fork(capsys):
    assert isolation_bench.main(["--subject", TOY, "--cases", "1", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "in process: median" in out and "isolated: median" in out
    assert "write-ahead record:" in out and "a child (fork, answer, reap)" in out
