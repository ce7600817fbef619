"""The scheduling driver's own checks: what a step's Plan may say (12-step-plan, 6-preemption-order),
outputs held while steps are in flight, and the outside KV store it plays.

The subject is vLLM's real Scheduler (`vllm:sched`, `vllm:async`); a plan is tampered with by
wrapping its `schedule`, as a buggy scheduler would report it. Skips without vllm.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List

import pytest

from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import InvalidOp
from kvledger.properties.drivers import driver_for
from kvledger.properties.scheduling_driver import ReplayStore, SchedulingDriver
from kvledger.properties.scheduling_subject import Plan
from kvledger.properties.subject import SubjectConfig
from kvledger.subjects import vllm_scheduler as vs

INSTALLED, _, DETAIL = vs.probe()
needs_vllm = pytest.mark.skipif(not INSTALLED, reason=f"vllm:sched is not usable here: {DETAIL}")

PS = 4
CFG = SubjectConfig(num_pages=6, page_size=PS, max_seq_len=24, max_running_req=4)
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]  # two full pages and two tokens


def _driver(spec: str = "vllm:sched", tamper: Callable[[Plan], Plan] | None = None) -> SchedulingDriver:
    subject = vs.build_spec(CFG, spec)
    if tamper is not None:
        schedule = subject.schedule
        subject.schedule = lambda budget: tamper(schedule(budget))  # type: ignore[method-assign]
    driver = driver_for(subject, CFG)
    assert isinstance(driver, SchedulingDriver)
    return driver


def _first(plan: Plan, **changes: Any) -> Plan:
    """The plan with its first scheduled request changed."""
    if not plan.scheduled:
        return plan
    first = dataclasses.replace(plan.scheduled[0], **changes)
    return dataclasses.replace(plan, scheduled=(first, *plan.scheduled[1:]))


@needs_vllm
def test_a_clean_run_prefills_decodes_and_ends_every_request() -> None:
    d = _driver()
    d.apply({"op": "submit", "uid": 0, "tokens": PROMPT, "max_tokens": 3})
    d.apply({"op": "submit", "uid": 1, "tokens": PROMPT[:6], "max_tokens": 2})
    out = d.apply({"op": "prefill", "budget": 64, "sample": [0]})
    assert out.batch == (0, 1) and d.running == [0, 1]
    assert d.witness.computed == {0: len(PROMPT), 1: 6}  # the prompt's KV and one sampled token each
    while d.running:
        d.apply({"op": "decode", "sample": [3]})
    assert not d.live and d.ended == {0, 1} and d.view().requests == {}
    assert d.witness.tokens[0] == PROMPT + [0, 3, 3]


@needs_vllm
@pytest.mark.parametrize(
    "change, message",
    [
        (dict(start=1), "scheduled for positions [1,"),
        (dict(end=40), "has 11 tokens"),
        (dict(drafts=(2,)), "verifies drafts [2]"),
    ],
)
def test_a_plan_that_does_not_follow_the_request_is_a_finding(change: dict, message: str) -> None:
    d = _driver(
        tamper=lambda plan: _first(plan, **change) if plan.scheduled and plan.scheduled[0].hit is None else plan
    )
    d.apply({"op": "submit", "uid": 0, "tokens": PROMPT, "max_tokens": 4})
    d.apply({"op": "prefill", "budget": 64, "sample": [0]})
    with pytest.raises(Finding) as caught:
        d.apply({"op": "decode", "sample": [0]})
    assert caught.value.kind == "12-step-plan" and message in caught.value.message


@needs_vllm
def test_a_step_over_its_budget_is_a_finding() -> None:
    d = _driver(tamper=lambda plan: _first(plan, end=plan.scheduled[0].end + 1) if plan.scheduled else plan)
    d.apply({"op": "submit", "uid": 0, "tokens": PROMPT, "max_tokens": 2})
    with pytest.raises(Finding) as caught:
        d.apply({"op": "prefill", "budget": 4, "sample": [0]})
    assert caught.value.kind == "12-step-plan" and "budget was 4" in caught.value.message


@needs_vllm
def test_a_victim_that_is_not_the_newest_admitted_request_is_a_finding() -> None:
    calls: List[int] = []

    def older_victim(plan: Plan) -> Plan:
        calls.append(1)
        return dataclasses.replace(plan, preempted=(0,)) if len(calls) == 2 else plan

    d = _driver(tamper=older_victim)
    d.apply({"op": "submit", "uid": 0, "tokens": PROMPT[:5], "max_tokens": 3})
    d.apply({"op": "submit", "uid": 1, "tokens": PROMPT[:6], "max_tokens": 3})
    d.apply({"op": "prefill", "budget": 64, "sample": [0]})
    with pytest.raises(Finding) as caught:
        d.apply({"op": "decode", "sample": [0]})
    assert caught.value.kind == "6-preemption-order" and "newest admitted request is uid 1" in caught.value.message


@needs_vllm
def test_accept_is_refused_for_a_subject_that_does_not_speculate() -> None:
    d = _driver()
    d.apply({"op": "submit", "uid": 0, "tokens": PROMPT, "max_tokens": 2})
    with pytest.raises(InvalidOp, match="speculates"):
        d.apply({"op": "decode", "sample": [0], "accept": [1]})


@needs_vllm
def test_async_outputs_reach_the_subject_one_step_late() -> None:
    d = _driver("vllm:async")
    delivered: List[List[int]] = []
    output = d.subject.output
    d.subject.output = lambda outs, loaded=(): (delivered.append(sorted(outs)), output(outs, loaded))[1]  # type: ignore[method-assign]
    d.apply({"op": "submit", "uid": 0, "tokens": PROMPT, "max_tokens": 3})
    d.apply({"op": "prefill", "budget": 64, "sample": [0]})
    assert delivered == [] and len(d.in_flight) == 1  # the prefill's output waits for the next step
    d.apply({"op": "decode", "sample": [0]})
    assert delivered == [[0]] and len(d.in_flight) == 1
    while d.live:
        d.apply({"op": "decode", "sample": [0]})
    assert d.view().requests == {} and not d.in_flight  # a step that schedules nothing flushes the rest


def test_the_replay_store_finds_whole_stored_pages_past_the_local_hit() -> None:
    store = ReplayStore(page_size=PS)
    store.save(PROMPT, computed=9)  # pages [0, 4) and [0, 8) are stored
    assert store.match(PROMPT, local_hit=0) == (8, False)  # the first load is synchronous
    assert store.match(PROMPT, local_hit=4) == (4, True)  # the next asynchronous
    assert store.match(PROMPT[:8], local_hit=0)[0] == 4  # never the last token
    assert store.match([9] + PROMPT[1:], local_hit=0) == (0, False)  # another prefix


@needs_vllm
def test_a_request_an_idle_pool_holds_but_never_admitted_is_a_liveness_finding() -> None:
    """vLLM keeps no margin of its pool: the driver took the request because the idle pool holds
    all of it, so a scheduler that never admits it (here: one that schedules nothing while nothing
    runs: its scheduler is never called) fails the drain, although the request was never preempted."""
    from kvledger.properties.subject_workload import drain

    subject = vs.build_spec(CFG, "vllm:sched")
    subject.schedule = lambda budget: Plan()  # type: ignore[method-assign]
    subject.output = lambda outputs, loaded: None  # type: ignore[method-assign]
    d = driver_for(subject, CFG)
    d.apply({"op": "submit", "uid": 0, "tokens": PROMPT, "max_tokens": 2})
    with pytest.raises(Finding) as found:
        drain(d, d.apply)
    assert found.value.kind == "liveness" and "waiting [0]" in str(found.value)
    clean = _driver()
    clean.apply({"op": "submit", "uid": 0, "tokens": PROMPT, "max_tokens": 2})
    drain(clean, clean.apply)
    assert clean.ended == {0}


@needs_vllm
def test_the_drain_of_a_scheduling_subject_tries_its_own_budget_after_a_stalled_walk() -> None:
    """A walk may end with prefills whose budgets were too small for what vLLM must schedule at
    once (vllm:spec resumes a request ready to decode with its token and its spec pads together),
    so they ran nothing; the drain still tries its own full-budget prefills before judging
    liveness (a 30-minute vllm:spec hunt flagged the idle pool otherwise, at case 177)."""
    from kvledger.properties.subject_workload import drain

    d = _driver()
    d.apply({"op": "submit", "uid": 0, "tokens": PROMPT, "max_tokens": 2})
    drain(d, d.apply, stalled=3)
    assert d.ended == {0}
