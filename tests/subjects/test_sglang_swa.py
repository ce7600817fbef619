"""`sglang:swa`: SGLang 0.5.23's UnifiedRadixCache with (FULL, SWA) components over its two pools
(`kvledger/subjects/sglang_swa.py`), judged op by op by the call-level driver, and its zoo.

Needs sglang (`subjects-constraints.txt`); every test skips with the reason without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Sequence, Set, Tuple

import pytest

from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.trace import read
from kvledger.properties.subject import SubjectConfig
from kvledger.properties.subject_driver import SubjectDriver
from kvledger.properties.target import config_of
from kvledger.subjects import parse_spec, sglang_swa
from kvledger.subjects.edits import SourceEdit

INSTALLED, VERSION, DETAIL = sglang_swa.probe()
pytestmark = pytest.mark.skipif(not INSTALLED, reason=f"sglang is not usable here: {DETAIL}")

PS = 4
W = sglang_swa.WINDOW_PAGES * PS
CFG = SubjectConfig(num_pages=16, page_size=PS, max_seq_len=60, max_running_req=4)
PROMPT = list(range(100, 120))  # 20 tokens, as in notes/field-paths.md section 6
TRACES = Path(__file__).parent / "sglang_swa_traces"  # `kvledger zoo --subject sglang:swa` (fuzz, seed 0)
# what each planted bug's minimized trace is found as
KINDS = {
    "sglang-swa-decode-window-a-page-short": "7-kv-provenance",
    "sglang-swa-checkpoint-frees-inside-window": "7-kv-provenance",
    "sglang-swa-free-keeps-mapping": "1-2-partition",
    "sglang-swa-frees-into-full-pool": "1-2-partition",
    "sglang-swa-available-reads-full": "9-counters",
    "sglang-swa-match-skips-tombstone-reset": "7-kv-provenance",
}


def _driver(edits: Sequence[SourceEdit] = (), config: SubjectConfig = CFG) -> Tuple[Any, SubjectDriver, Set[str]]:
    subject = sglang_swa.build(config, None, edits)
    events: Set[str] = set()
    return subject, SubjectDriver(subject, config, on_event=events.add), events


def _judged(driver: SubjectDriver, op: str, *args: Any, **kwargs: Any) -> Any:
    result = getattr(driver, op)(*args, **kwargs)
    driver.judge()
    return result


def test_listed_with_two_pools_and_the_window():
    assert parse_spec("sglang:swa").adapter() is sglang_swa
    subject, _, _ = _driver()
    caps = subject.capabilities
    (swa_pool,) = caps.group_pools
    assert len(swa_pool) == CFG.num_pages and not set(swa_pool) & set(caps.pages)
    view = subject.view()
    (group,) = view.groups
    assert group.window == W == subject.tree.sliding_window_size
    assert sorted(group.free or []) == list(swa_pool) and sorted(view.free) == list(caps.pages)
    assert group.counters["free_pages"] == CFG.num_pages


def _swa_row(subject: Any, uid: int) -> List[int | None]:
    return subject.view().groups[0].requests[uid]


def test_decode_frees_the_swa_slots_that_left_the_window():
    """Chunked prefill, then decodes: the request's own SWA slots past the tree's prefix are freed
    once out of the window (maybe_evict_swa at each decode's allocation), never one the window
    reads, and SGLang's cursor says how far."""
    subject, driver, events = _driver()
    _judged(driver, "submit", 0, PROMPT, 24)
    for _ in range(3):
        _judged(driver, "prefill", 8, sample=[7])
    free_before = subject.allocator.swa_available_size()
    for step in range(16):
        _judged(driver, "decode", sample=[50 + step])
        computed = driver.witness.computed[0]
        row = _swa_row(subject, 0)
        dropped = [p for p, loc in enumerate(row) if loc is None]
        assert all(p < computed - W + 1 for p in dropped), (computed, dropped)
    req = subject.requests[0].req
    evicted = req.kv.get_evicted_seqlen(subject.s.ComponentType.SWA)
    assert evicted > len(PROMPT)  # decode positions freed, past the tree-owned prompt
    assert row[len(PROMPT) : evicted] == [None] * (evicted - len(PROMPT))
    assert None not in row[evicted:]
    assert subject.allocator.swa_available_size() > free_before - 16
    assert "window: positions dropped outside the window" in events


def test_a_prefix_hit_holds_the_window_in_both_groups():
    subject, driver, events = _driver()
    _judged(driver, "submit", 0, PROMPT, 2)
    _judged(driver, "prefill", 64, sample=[7])
    _judged(driver, "submit", 1, PROMPT + [1, 2, 3], 2)
    _judged(driver, "prefill", 64, sample=[8])
    view = subject.view()
    assert view.requests[1][: len(PROMPT)] == view.requests[0][: len(PROMPT)]
    swa = view.groups[0].requests[1]
    assert None not in swa[len(PROMPT) - W + 1 : len(PROMPT)]
    assert "window: a prefix hit in every group" in events


def test_both_pools_come_back():
    subject, driver, _ = _driver()
    _judged(driver, "submit", 0, PROMPT, 6)
    _judged(driver, "submit", 1, PROMPT[:10] + [1, 2, 3], 6)
    for _ in range(40):
        if driver.waiting:
            _judged(driver, "prefill", 8, sample=[5])
        elif driver.running:
            _judged(driver, "decode", sample=[6])
    view = subject.view()
    assert not view.requests and not view.groups[0].requests
    cached = sum(len(e.locations) for e in view.cached if not e.group)
    _judged(driver, "evict", cached)
    view = subject.view()
    assert sorted(view.free) == list(subject.capabilities.pages)
    assert sorted(view.groups[0].free or []) == list(subject.capabilities.group_pools[0])


def _replay(edits: Sequence[SourceEdit], path: Path) -> None:
    header, ops = read(path)
    config = config_of(header)
    subject = sglang_swa.build(config, None, edits)
    driver = SubjectDriver(subject, config)
    for op in ops:
        driver.apply(op)


def test_the_zoo_is_listed():
    assert {e.name for e in sglang_swa.ZOO} == set(KINDS)
    assert parse_spec("sglang:swa").zoo() == sglang_swa.ZOO


@pytest.mark.parametrize("edit", sglang_swa.ZOO, ids=lambda e: e.name)
def test_zoo_bug_is_caught_and_the_clean_subject_passes(edit: SourceEdit):
    path = TRACES / f"{edit.name}.jsonl"
    with pytest.raises(Finding) as found:
        _replay([edit], path)
    assert found.value.kind == KINDS[edit.name], found.value
    _replay([], path)


def test_a_decode_that_frees_inside_the_window_is_caught_at_its_read():
    """The decode frees the SWA slot of a position its own forward pass reads: the call-level
    driver's read check (properties/group_writes.py) names the step, before the judge's window
    clause, which looks from the next position on, could."""
    (edit,) = [e for e in sglang_swa.ZOO if e.name == "sglang-swa-decode-window-a-page-short"]
    with pytest.raises(Finding, match="the step computes position"):
        _replay([edit], TRACES / f"{edit.name}.jsonl")


def test_a_decode_that_does_not_fit_retracts_in_retract_decodes_order():
    """Two requests of up to 12 tokens in 10 pages: uid 1 (12-token prompt) admitted alone, uid 2
    (8 tokens) at the next step, charged for uid 1's decode at the 0.05 ratio. Both have one output
    when they decode; at the page neither pool can give, check_decode_mem fails and retract_decode
    pops the longest prompt of equal outputs: uid 1, the older one, not the driver's newest."""
    config = SubjectConfig(num_pages=10, page_size=PS, max_seq_len=32)
    subject, driver, events = _driver(config=config)
    driver.apply({"op": "submit", "uid": 1, "tokens": list(range(1, 13)), "max_tokens": 12})
    driver.apply({"op": "submit", "uid": 2, "tokens": list(range(21, 29)), "max_tokens": 12})
    assert driver.apply({"op": "prefill", "budget": 12}).batch == (1,)
    assert driver.apply({"op": "prefill", "budget": 64}).batch == (2,)
    preempted: List[int] = []
    while not preempted and driver.running:
        preempted = list(driver.apply({"op": "decode"}).preempted or ())
    assert preempted == [1] and driver.running == [2], preempted
    assert subject.requests[1].phase == "waiting" and subject.requests[1].req.is_retracted
    assert "preempt: the subject chose a victim other than the newest" in events
