"""The fault spec's grammar: what parses, what each field means, and the errors bad specs get."""

from __future__ import annotations

import pytest

from kvledger.engine.runtime.faults import ENV_VAR, Fault, FaultPlan


def test_one_fault_with_every_key() -> None:
    plan = FaultPlan.parse("alloc-refuse@step=3,request=12,seed=7,times=2")
    assert plan.faults == (Fault("alloc-refuse", 3, request=12, seed=7, times=2),)


def test_several_faults_and_their_own_keys() -> None:
    plan = FaultPlan.parse(" forward-raise@step=5 ; step-stall@step=20,seconds=2.5;rank-kill@step=4,rank=1;")
    assert [f.kind for f in plan.faults] == ["forward-raise", "step-stall", "rank-kill"]
    assert plan.faults[1].seconds == 2.5 and plan.faults[1].times == 1
    assert plan.faults[2].rank == 1
    assert FaultPlan.parse("step-stall@step=1").faults[0].seconds is None  # forever


@pytest.mark.parametrize(
    "spec, words",
    [
        ("", "empty"),
        ("oops@step=1", "unknown kind 'oops'"),
        ("forward-raise", "expected forward-raise@step=N"),
        ("forward-raise@", "expected forward-raise@step=N"),
        ("forward-raise@request=3", "step=N is required"),
        ("forward-raise@step=0", "step=0 must be >= 1"),
        ("forward-raise@step=x", "step='x' is not an integer"),
        ("forward-raise@step=1,colour=red", "unknown key 'colour'"),
        ("forward-raise@step=1,step=2", "'step' given twice"),
        ("forward-raise@step=1,times", "'times' is not key=value"),
        ("forward-raise@step=1,times=0", "times=0 must be >= 1"),
        ("forward-raise@step=1,seconds=3", "seconds= applies to step-stall only"),
        ("step-stall@step=1,seconds=-1", "must be a positive finite number"),
        ("step-stall@step=1,seconds=nan", "must be a positive finite number"),
        ("step-stall@step=1,seconds=soon", "is not a number"),
        ("rank-stop@step=2", "rank-stop needs rank=R"),
        ("cuda-poison@step=2,rank=1", "rank= applies to rank-kill and rank-stop only"),
        ("forward-raise@step=1;bad@step=2", "unknown kind 'bad'"),
    ],
)
def test_bad_specs_say_what_was_wrong(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        FaultPlan.parse(spec)
    assert words in str(err.value)


def test_due_fires_at_or_after_the_step_times_times() -> None:
    plan = FaultPlan.parse("forward-raise@step=3,times=2")
    assert [plan.due("forward-raise", s) is not None for s in range(1, 7)] == [False, False, True, True, False, False]
    assert plan.due("alloc-refuse", 9) is None
    assert plan.fired() == {"forward-raise": 2}
    assert not plan.wants("forward-raise")


def test_a_fault_naming_a_request_waits_for_it() -> None:
    plan = FaultPlan.parse("forward-raise@step=2,request=5")
    assert plan.due("forward-raise", 3) is None
    assert plan.due("forward-raise", 3, request=4) is None
    assert plan.due("forward-raise", 4, request=5) == Fault("forward-raise", 2, request=5)
    assert plan.due("forward-raise", 5, request=5) is None


def test_the_request_a_fault_picks_is_a_function_of_seed_and_step() -> None:
    uids = [10, 11, 12, 13, 14, 15]
    picks = {s: Fault("alloc-refuse", 1, seed=s).pick(4, uids) for s in range(20)}
    assert picks == {s: Fault("alloc-refuse", 1, seed=s).pick(4, list(reversed(uids))) for s in range(20)}
    assert len(set(picks.values())) > 1  # the seed matters
    assert Fault("alloc-refuse", 1, request=12).pick(4, uids) == 12
    assert Fault("alloc-refuse", 1, request=99).pick(4, uids) is None
    plan = FaultPlan.parse("alloc-refuse@step=1,request=99")
    assert plan.due_in_batch("alloc-refuse", 2, uids) is None
    assert plan.due_in_batch("alloc-refuse", 3, [99, 1]) == (plan.faults[0], 99)


def test_option_wins_over_environment_and_off_by_default() -> None:
    assert FaultPlan.from_env({}) is None
    assert FaultPlan.from_env({ENV_VAR: "  "}) is None
    env = {ENV_VAR: "cuda-poison@step=4"}
    assert FaultPlan.resolve(None, env).faults[0].kind == "cuda-poison"  # type: ignore[union-attr]
    assert FaultPlan.resolve("forward-raise@step=1", env).faults[0].kind == "forward-raise"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="unknown kind"):
        FaultPlan.from_env({ENV_VAR: "nope@step=1"})


def test_str_round_trips() -> None:
    spec = "alloc-refuse@step=3,request=12,times=2,seed=7;step-stall@step=1,seconds=2.0;rank-stop@step=9,rank=1"
    plan = FaultPlan.parse(spec)
    assert FaultPlan.parse(";".join(map(str, plan.faults))).faults == plan.faults
