"""`vllm:hybrid`: vLLM's real Scheduler over a full-attention and a sliding-window KV group
(`kvledger/subjects/vllm_hybrid.py`), judged step by step by the scheduling driver, and its zoo.

Needs vllm and einops (`subjects-constraints.txt`); every test skips with the reason without them.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import pytest

from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import InvalidOp
from kvledger.properties.scheduling_driver import SchedulingDriver
from kvledger.properties.scheduling_subject import Plan
from kvledger.properties.subject import SubjectConfig
from kvledger.subjects import vllm_hybrid
from kvledger.subjects.edits import SourceEdit

INSTALLED, VERSION, DETAIL = vllm_hybrid.probe()
pytestmark = pytest.mark.skipif(not INSTALLED, reason=f"vllm is not usable here: {DETAIL}")

PS = 4
W = vllm_hybrid.WINDOW_BLOCKS * PS
CFG = SubjectConfig(num_pages=16, page_size=PS, max_seq_len=48, max_running_req=4)
PROMPT = list(range(100, 120))  # 20 tokens: five full blocks


class Recorded:
    """A subject's plans, as the driver got them."""

    def __init__(self, subject: Any) -> None:
        self.plans: List[Plan] = []
        schedule = subject.schedule

        def recorded(budget: Any) -> Plan:
            plan: Plan = schedule(budget)
            self.plans.append(plan)
            return plan

        subject.schedule = recorded


def _driver(edits: Sequence[SourceEdit] = (), config: SubjectConfig = CFG) -> Tuple[Any, SchedulingDriver, Recorded]:
    subject = vllm_hybrid.build(config, None, edits)
    recorded = Recorded(subject)
    return subject, SchedulingDriver(subject, config), recorded


def _first_request(driver: SchedulingDriver, decodes: int) -> None:
    """uid 0: PROMPT in chunks of 8, 8, 4, then `decodes` decode steps (every step judged)."""
    driver.submit(0, PROMPT, 12)
    for _ in range(3):
        driver.prefill(8)
    for _ in range(decodes):
        driver.decode(sample=[7])


def test_window_group_drops_blocks_behind_its_window():
    subject, driver, _ = _driver()
    _first_request(driver, decodes=6)
    view = subject.view()
    (group,) = view.groups
    assert group.window == W
    computed = driver.witness.computed[0]
    assert computed == len(PROMPT) + 6
    full, window = view.requests[0], group.requests[0]
    assert len(full) == len(window) and None not in full
    # blocks wholly before computed - W + 1 went back to the pool as the null block; the window's
    # positions and everything after them stay
    edge = (computed - W + 1) // PS * PS
    assert window[:edge] == [None] * edge
    assert None not in window[edge:computed]
    held = {loc // PS for loc in full} | {loc // PS for loc in window if loc is not None}
    assert view.counters["free_pages"] == CFG.num_pages - len(held)
    assert not set(view.free) & held


def test_each_group_files_its_blocks_under_its_own_key():
    subject, driver, _ = _driver()
    _first_request(driver, decodes=0)
    view = subject.view()
    groups = {e.group for e in view.cached}
    assert groups == {0, 1}
    for group in (0, 1):
        keys = {e.key for e in view.cached if e.group == group}
        for end in range(PS, len(PROMPT) + 1, PS):
            assert subject.cache_key(PROMPT[:end], group) in keys
    assert subject.cache_key(PROMPT[:8], 0) != subject.cache_key(PROMPT[:8], 1)


def test_a_prefix_hit_is_found_in_both_groups():
    """A second request sharing 16 tokens hits 16 in both groups: the full-attention group from
    its cached blocks, the window group with the window's contiguous blocks and null blocks before."""
    subject, driver, recorded = _driver()
    _first_request(driver, decodes=2)
    driver.submit(1, PROMPT[:16] + [5, 6, 7, 8], 4)
    driver.prefill(16)
    (admitted,) = [s for s in recorded.plans[-1].scheduled if s.uid == 1]
    assert admitted.hit == 16 and admitted.start == 16
    view = subject.view()
    full, window = view.requests[1], view.groups[0].requests[1]
    assert full[:16] == view.requests[0][:16]
    contiguous = -(-(W - 1) // PS) * PS  # cdiv(W - 1, block_size) blocks
    assert window[: 16 - contiguous] == [None] * (16 - contiguous)
    assert None not in window[16 - contiguous : 16]
    for _ in range(6):
        driver.decode(sample=[3])


def test_the_pool_comes_back_when_every_request_ends():
    subject, driver, _ = _driver()
    _first_request(driver, decodes=12)
    driver.submit(1, PROMPT[:12] + [1, 2, 3], 3)
    for _ in range(3):
        driver.prefill(16)
    for _ in range(4):
        driver.decode(sample=[5])
    view = subject.view()
    assert not view.requests and all(not g.requests for g in view.groups)
    assert view.counters["free_pages"] == CFG.num_pages
    assert sorted(view.free) == list(range(1, CFG.num_pages + 1))


def ops_of(trace: Tuple[str, Dict[str, int], List[Dict[str, Any]]]) -> Tuple[str, SubjectConfig, List[Dict[str, Any]]]:
    kind, shape, lines = trace
    return kind, SubjectConfig(**shape), lines


# Each zoo bug's minimized trace from `kvledger zoo --subject vllm:hybrid` (fuzz, seed 0): the
# finding's kind, the pool, the operations
HYBRID_TRACES: Dict[str, Tuple[str, Dict[str, int], List[Dict[str, Any]]]] = {
    # `kvledger check --subject vllm:hybrid --bug vllm-swa-window-one-short` (sequence 8): caught as the
    # step reads the freed position, by the scheduling driver's window-read check
    "vllm-swa-window-one-short": (
        "7-kv-provenance",
        {"num_pages": 8, "page_size": 2, "max_seq_len": 16, "max_running_req": 5},
        [
            {"op": "submit", "uid": 0, "tokens": [1, 1, 1, 0], "max_tokens": 2},
            {"op": "prefill", "budget": 64, "sample": [3]},
            {"op": "decode", "sample": [2], "stop": []},
        ],
    ),
    "vllm-hybrid-hit-not-reduced": (
        "7-kv-provenance",
        {"num_pages": 12, "page_size": 4, "max_seq_len": 48, "max_running_req": 7},
        [
            {"op": "submit", "uid": 0, "tokens": [2, 3], "max_tokens": 1},
            {"op": "prefill", "budget": 64, "sample": [2]},
        ],
    ),
    "vllm-swa-hit-not-contiguous": (
        "7-kv-provenance",
        {"num_pages": 27, "page_size": 2, "max_seq_len": 48, "max_running_req": 5},
        [
            {"op": "submit", "uid": 2, "tokens": [0], "max_tokens": 5},
            {"op": "submit", "uid": 3, "tokens": [0], "max_tokens": 6},
            {"op": "prefill", "budget": 64, "sample": [0]},
            {"op": "submit", "uid": 4, "tokens": [3, 0, 1, 2, 0, 3, 3, 2, 1, 3], "max_tokens": 2},
            {"op": "submit", "uid": 5, "tokens": [3, 0], "max_tokens": 3},
            {"op": "prefill", "budget": 4, "sample": [3]},
            {"op": "prefill", "budget": 3, "sample": [3]},
            {"op": "decode", "sample": [3], "stop": []},
            {"op": "decode", "sample": [3], "stop": []},
            {"op": "submit", "uid": 6, "tokens": [3, 0, 1, 2, 0, 3, 3, 2, 1], "max_tokens": 1},
            {"op": "prefill", "budget": 4, "sample": [2]},
        ],
    ),
    "vllm-swa-hit-skip-round-up": (
        "7-kv-provenance",
        {"num_pages": 12, "page_size": 4, "max_seq_len": 48, "max_running_req": 7},
        [
            {"op": "submit", "uid": 0, "tokens": [2, 3, 3, 2, 3, 2, 2, 0], "max_tokens": 1},
            {"op": "submit", "uid": 1, "tokens": [2, 3, 3, 2, 3, 2, 2, 0, 0], "max_tokens": 1},
            {"op": "prefill", "budget": 64, "sample": [1]},
        ],
    ),
    "vllm-swa-hit-window-round-down": (
        "7-kv-provenance",
        {"num_pages": 12, "page_size": 4, "max_seq_len": 48, "max_running_req": 7},
        [
            {"op": "submit", "uid": 0, "tokens": [2, 3, 3, 2, 3, 2, 2, 0], "max_tokens": 1},
            {"op": "submit", "uid": 1, "tokens": [2, 3, 3, 2, 3, 2, 2, 0, 0], "max_tokens": 1},
            {"op": "prefill", "budget": 64, "sample": [1]},
        ],
    ),
    "vllm-swa-remove-keeps-freed-block": (
        "1-2-partition",
        {"num_pages": 12, "page_size": 4, "max_seq_len": 48, "max_running_req": 7},
        [
            {"op": "submit", "uid": 0, "tokens": [2, 3, 3, 2, 3, 2, 2, 0, 0, 0, 3], "max_tokens": 2},
            {"op": "prefill", "budget": 64, "sample": [2]},
            {"op": "prefill", "budget": 64, "sample": [1]},
        ],
    ),
    "vllm-swa-room-skips-round-up": (
        "subject-raised:ValueError",
        {"num_pages": 12, "page_size": 4, "max_seq_len": 48, "max_running_req": 7},
        [
            {"op": "submit", "uid": 0, "tokens": [2, 3, 3, 2, 0, 0, 0, 1], "max_tokens": 1},
            {"op": "submit", "uid": 1, "tokens": [2, 3, 3, 2, 3, 2, 1, 1, 2, 0, 3, 2, 1, 1, 0, 2, 0], "max_tokens": 2},
            {"op": "submit", "uid": 2, "tokens": [2, 3, 3, 2, 0, 0, 0, 1, 1], "max_tokens": 1},
            {"op": "prefill", "budget": 64, "sample": [0]},
            {"op": "prefill", "budget": 64, "sample": [2]},
        ],
    ),
    "vllm-swa-skipped-blocks-round-up": (
        "7-kv-provenance",
        {"num_pages": 12, "page_size": 4, "max_seq_len": 48, "max_running_req": 7},
        [
            {"op": "submit", "uid": 0, "tokens": [2, 3, 3, 2, 3, 2, 2, 0], "max_tokens": 2},
            {"op": "prefill", "budget": 64, "sample": [2]},
            {"op": "prefill", "budget": 64, "sample": [1]},
        ],
    ),
}


def _replay(edits: Sequence[SourceEdit], lines: Sequence[Dict[str, Any]], config: SubjectConfig) -> None:
    _, driver, _ = _driver(edits, config)
    for line in lines:
        driver.apply(line)


@pytest.mark.parametrize("name", sorted(HYBRID_TRACES))
def test_zoo_bug_is_caught_and_the_clean_subject_passes(name):
    """Each planted bug's minimized trace (from `kvledger zoo --subject vllm:hybrid`, seed 0) is a
    finding of its kind with the bug, and replays clean without it."""
    (edit,) = [e for e in vllm_hybrid.ZOO if e.name == name]
    kind, config, lines = ops_of(HYBRID_TRACES[name])
    with pytest.raises(Finding) as found:
        _replay([edit], lines, config)
    assert found.value.kind == kind, found.value
    _replay([], lines, config)


def test_every_zoo_bug_has_a_trace():
    assert {e.name for e in vllm_hybrid.ZOO} == set(HYBRID_TRACES)


def test_a_request_is_taken_only_if_every_group_can_hold_it_from_position_zero():
    """A window group frees what left the window only after a step computed it, and a preempted
    request starts again at position 0: at its peak a request holds a page per page_size
    positions in both groups, as vLLM's startup check sizes the window group. The driver once
    counted the window group as its window's pages, took a 15-token request on a 14-block pool
    (page 2), and a fuzz case then found it never re-admitted after a preemption: no vLLM bug,
    vLLM would refuse to start on that pool (check_enough_kv_cache_memory)."""
    config = SubjectConfig(num_pages=14, page_size=2, max_seq_len=28, max_running_req=4)
    _, driver, _ = _driver(config=config)
    driver.submit(0, list(range(100, 113)), 2)  # 14 positions: 7 pages in each group, the whole pool
    with pytest.raises(InvalidOp, match="can never fit the pool of 14 pages"):
        driver.submit(1, list(range(100, 113)), 3)  # 15 positions: 8 pages in each group
    assert driver.prefill(64).batch == (0,)  # the one taken runs from position 0 in one step
    assert driver.running == [0]
