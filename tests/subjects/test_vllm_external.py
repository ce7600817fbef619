"""`vllm:external`: vLLM's real Scheduler with ExampleConnector's scheduler side loading KV from
the driver's store (`kvledger/subjects/vllm_external.py`), judged step by step, and its zoo.

Needs vllm and einops (`subjects-constraints.txt`); every test skips with the reason without them.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import pytest

from kvledger.engine.ledger.finding import Finding
from kvledger.properties.scheduling_driver import SchedulingDriver
from kvledger.properties.scheduling_subject import Plan
from kvledger.properties.subject import SubjectConfig, View
from kvledger.subjects import vllm_external
from kvledger.subjects.edits import SourceEdit

INSTALLED, VERSION, DETAIL = vllm_external.probe()
pytestmark = pytest.mark.skipif(not INSTALLED, reason=f"vllm is not usable here: {DETAIL}")

PS = 4
CFG = SubjectConfig(num_pages=12, page_size=PS, max_seq_len=48, max_running_req=4)
P = list(range(100, 120))  # 20 tokens
R = list(range(300, 320))
Q = list(range(200, 240))  # 40 tokens: evicts most of what P and R left cached


class Recorded:
    """A subject's plans, each with the View right after it was scheduled."""

    def __init__(self, subject: Any) -> None:
        self.steps: List[Tuple[Plan, View]] = []
        schedule = subject.schedule

        def recorded(budget: Any) -> Plan:
            plan: Plan = schedule(budget)
            self.steps.append((plan, subject.view()))
            return plan

        subject.schedule = recorded


def _driver(edits: Sequence[SourceEdit] = (), config: SubjectConfig = CFG) -> Tuple[Any, SchedulingDriver, Recorded]:
    subject = vllm_external.build(config, None, edits)
    recorded = Recorded(subject)
    driver = SchedulingDriver(subject, config)
    return subject, driver, recorded


def _run(driver: SchedulingDriver, uid: int, prompt: List[int], max_tokens: int = 1) -> None:
    driver.submit(uid, prompt, max_tokens)
    for _ in range(4):
        driver.prefill(64)
    while driver.running:
        driver.decode(sample=[7])


def _loads(driver: SchedulingDriver) -> None:
    """P and R computed (the store keeps their prefixes), evicted from the pool by Q, then asked
    for again: P's store hit is the store's first (synchronous), R's its second (asynchronous)."""
    for uid, prompt in ((0, P), (1, R), (2, Q)):
        _run(driver, uid, prompt)
    _run(driver, 3, P + [1, 2])
    _run(driver, 4, R + [3, 4], max_tokens=3)


def test_the_driver_gives_the_subject_its_store():
    subject, driver, _ = _driver()
    assert subject.capabilities.external_kv
    assert subject.store is driver.store


def test_a_synchronous_load_is_computed_in_the_step_that_admits_it():
    subject, driver, recorded = _driver()
    _loads(driver)
    (item,) = [s for plan, _ in recorded.steps for s in plan.scheduled if s.uid == 3 and s.hit is not None]
    plan = next(p for p, _ in recorded.steps if item in p.scheduled)
    assert item.external > 0 and item.external % PS == 0 and 3 not in plan.loading
    assert item.start == item.hit and item.end == len(P) + 2


def test_an_asynchronous_load_holds_unhashed_blocks_until_it_completes():
    subject, driver, recorded = _driver()
    _loads(driver)
    ((plan, view),) = [(p, v) for p, v in recorded.steps if 4 in p.loading]
    (item,) = [s for s in plan.scheduled if s.uid == 4]
    local = item.hit - item.external
    assert item.external > 0 and item.start == item.end == local
    # WAITING_FOR_REMOTE_KVS: its blocks are allocated for local + external tokens, none filed in
    # the prefix cache until the load is done
    row = view.requests[4]
    assert len(row) == item.hit
    loading = {loc // PS for loc in row[local:]}
    assert not loading & {loc // PS for e in view.cached for loc in e.locations}
    assert all(view.page_refs[page] == 1 for page in loading)
    # the next step files them and computes the rest of the prompt: no second admission
    after = [s for p, _ in recorded.steps[recorded.steps.index((plan, view)) + 1 :] for s in p.scheduled if s.uid == 4]
    assert after[0].hit is None and after[0].start == item.hit
    assert subject.view().requests == {}


def test_an_abort_while_the_kv_loads_gives_the_blocks_back():
    subject, driver, recorded = _driver()
    for uid, prompt in ((0, P), (1, R), (2, Q)):
        _run(driver, uid, prompt)
    _run(driver, 3, P + [1, 2])  # the store's synchronous hit
    driver.submit(4, R + [3, 4], 3)
    driver.prefill(64)
    assert 4 in recorded.steps[-1][0].loading
    # delivered with the step's outputs: the load is done, the rest not yet scheduled
    driver.abort(4)
    view = subject.view()
    assert view.requests == {} and view.counters["free_pages"] == CFG.num_pages


def test_without_a_store_nothing_loads():
    subject = vllm_external.build(CFG, None, ())
    assert subject.store is None
    subject.submit(0, P, 1)
    plan = subject.schedule(None)
    assert [(s.uid, s.hit, s.external) for s in plan.scheduled] == [(0, 0, 0)] and not plan.loading


def _ops(trace: Tuple[str, Dict[str, int], List[Dict[str, Any]]]) -> Tuple[str, SubjectConfig, List[Dict[str, Any]]]:
    kind, shape, lines = trace
    return kind, SubjectConfig(**shape), lines


# Each zoo bug's minimized trace from `kvledger zoo --subject vllm:external` (fuzz, seed 0): the
# finding's kind, the pool, the operations
EXTERNAL_TRACES: Dict[str, Tuple[str, Dict[str, int], List[Dict[str, Any]]]] = {
    "vllm-ext-caches-before-load": (
        "7-kv-provenance",
        {"num_pages": 6, "page_size": 4, "max_seq_len": 24, "max_running_req": 5},
        [
            {"op": "submit", "uid": 1, "tokens": [1, 2, 2, 0, 2, 1, 2, 0, 0, 2, 0, 1, 0, 3, 2], "max_tokens": 3},
            {"op": "submit", "uid": 2, "tokens": [0, 1, 3, 2, 1, 1, 0, 0], "max_tokens": 2},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "decode", "sample": [1]},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "prefill", "budget": 64, "sample": [1]},
        ],
    ),
    "vllm-ext-computed-misses-external": (
        "8-request",
        {"num_pages": 8, "page_size": 4, "max_seq_len": 32, "max_running_req": 4},
        [
            {"op": "submit", "uid": 0, "tokens": [0, 3, 3, 0, 3, 0, 0, 0, 0, 2], "max_tokens": 8},
            {"op": "submit", "uid": 1, "tokens": [0, 3, 3, 0, 3, 0, 0, 0, 0, 2], "max_tokens": 8},
            {
                "op": "submit",
                "uid": 2,
                "tokens": [0, 0, 3, 1, 3, 0, 3, 2, 3, 3, 0, 3, 1, 3, 1, 3, 1, 0, 2, 3, 1],
                "max_tokens": 1,
            },
            {"op": "submit", "uid": 3, "tokens": [0, 0, 3, 1, 3, 2, 3, 2, 1], "max_tokens": 5},
            {"op": "submit", "uid": 4, "tokens": [3, 3, 2, 2, 1, 3, 0, 0, 0, 3, 3, 1, 3, 3], "max_tokens": 1},
            {"op": "submit", "uid": 5, "tokens": [0, 3, 3, 0, 3, 0, 0, 0, 0, 2], "max_tokens": 5},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "prefill", "budget": 64, "sample": [1]},
        ],
    ),
    "vllm-ext-connector-asked-from-zero": (
        "subject-raised:AssertionError",
        {"num_pages": 25, "page_size": 2, "max_seq_len": 48, "max_running_req": 3},
        [
            {"op": "submit", "uid": 0, "tokens": [2, 3], "max_tokens": 1},
            {"op": "prefill", "budget": 64, "sample": [0]},
            {"op": "submit", "uid": 1, "tokens": [2, 3, 3], "max_tokens": 1},
            {"op": "decode", "sample": [1], "stop": []},
        ],
    ),
    # minimized by `kvledger check --subject vllm:external --bug NAME` after outside loads began completing
    # with the next step's outputs (an abort can come while KV loads)
    "vllm-ext-loaded-abort-delays-free": (
        "8-request",
        {"num_pages": 8, "page_size": 2, "max_seq_len": 16, "max_running_req": 5},
        [
            {"op": "submit", "uid": 0, "tokens": [3, 0, 2, 2], "max_tokens": 1},
            {"op": "submit", "uid": 1, "tokens": [3, 0], "max_tokens": 1},
            {"op": "submit", "uid": 2, "tokens": [3, 0], "max_tokens": 2},
            {"op": "submit", "uid": 3, "tokens": [3, 0, 2, 3, 0, 2, 2, 2], "max_tokens": 5},
            {"op": "prefill", "budget": 64, "sample": [0]},
            {"op": "submit", "uid": 4, "tokens": [3, 0, 2, 2, 1], "max_tokens": 1},
            {"op": "decode", "sample": [0], "stop": []},
            {"op": "prefill", "budget": 64, "sample": [3]},
            {"op": "prefill", "budget": 64, "sample": [2]},
            {"op": "abort", "uid": 4},
        ],
    ),
    "vllm-ext-loaded-request-looked-up-again": (
        "subject-raised:AssertionError",
        {"num_pages": 6, "page_size": 4, "max_seq_len": 24, "max_running_req": 5},
        [
            {"op": "submit", "uid": 1, "tokens": [1, 2, 2, 0, 2, 1, 2, 0, 0, 2, 0, 1, 0, 3, 2], "max_tokens": 3},
            {"op": "submit", "uid": 2, "tokens": [0, 1, 3, 2, 1, 1, 0, 0], "max_tokens": 2},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "decode", "sample": [1]},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "decode", "sample": [1]},
        ],
    ),
}


def _replay(edits: Sequence[SourceEdit], lines: Sequence[Dict[str, Any]], config: SubjectConfig) -> None:
    _, driver, _ = _driver(edits, config)
    for line in lines:
        driver.apply(line)


@pytest.mark.parametrize("name", sorted(EXTERNAL_TRACES))
def test_zoo_bug_is_caught_and_the_clean_subject_passes(name):
    """Each planted bug's minimized trace (from `kvledger zoo --subject vllm:external`, seed 0) is a
    finding of its kind with the bug, and replays clean without it."""
    (edit,) = [e for e in vllm_external.ZOO if e.name == name]
    kind, config, lines = _ops(EXTERNAL_TRACES[name])
    with pytest.raises(Finding) as found:
        _replay([edit], lines, config)
    assert found.value.kind == kind, found.value
    _replay([], lines, config)


def test_every_zoo_bug_has_a_trace():
    assert {e.name for e in vllm_external.ZOO} == set(EXTERNAL_TRACES)
