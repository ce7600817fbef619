"""The worked misfit subject (docs/examples/lazy_paging_subject.py): a paging manager that evicts
before it admits, keeps a preempted request's pages, names its own victim and whose block map
holds a reference of its own. Declared, it passes judge mode; with each capability switched off
the judge reports that misfit; each of four planted bugs, one per capability's area, is caught
with its invariant. Counts and seeds decide, never time."""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from typing import Callable, Dict, List

import pytest

from kvledger.checker import check_subject
from kvledger.engine.ledger.finding import Finding
from kvledger.properties.subject import SubjectConfig
from kvledger.properties.subject_driver import SubjectDriver
from tests.support.paths import ROOT

sys.path.insert(0, str(ROOT / "docs" / "examples"))  # the example imports as the docs show
import lazy_paging_subject as example  # noqa: E402

from kvledger.checker.subject_walk import run_case  # noqa: E402

SEEDS = range(30)


def findings(factory: Callable[[SubjectConfig], example.LazyPagingCache]) -> Dict[str, List[str]]:
    """kind -> the messages of the fuzz cases of SEEDS that found it."""
    out: Dict[str, List[str]] = {}
    for seed in SEEDS:
        finding = run_case(factory, seed).finding
        if finding is not None:
            out.setdefault(finding.kind, []).append(finding.message)
    return out


def without(capability: str) -> Callable[[SubjectConfig], example.LazyPagingCache]:
    def build(config: SubjectConfig) -> example.LazyPagingCache:
        subject = example.LazyPagingCache(config)
        subject.capabilities = dataclasses.replace(subject.capabilities, **{capability: False})
        return subject

    return build


def test_the_declared_example_passes_judge_mode_and_reaches_the_misfit_states(tmp_path):
    assert findings(example.build) == {}
    report = check_subject(example.build, examples=60, out_dir=tmp_path)
    assert "passed" in report
    for event in ("admission: evicted, then refused", "admission: resumed on the pages it kept"):
        assert f"[x] {event}" in report
    assert "[x] preempt: the subject chose a victim other than the newest" in report


@pytest.mark.parametrize(
    "capability, kind, words",
    [
        ("evicts_before_admit", "4-failed-admission", "cached entries removed"),
        ("preempt_keeps_pages", "8-request", "does not declare preempt_keeps_pages"),
        ("cache_holds_reference", "1-2-partition", "reference count"),
    ],
)
def test_without_its_capability_each_misfit_is_reported(capability, kind, words):
    found = findings(without(capability))
    assert kind in found, found.keys()
    assert any(words in message for message in found[kind])


# two requests sharing a cached page fill a 4-page pool; at the second decode the older one needs
# a new page and finds none, while the newer one writes into the page it has
TWO_ON_A_FULL_POOL = [
    {"op": "submit", "uid": 0, "tokens": [1, 2, 3], "max_tokens": 4},
    {"op": "prefill", "budget": 64, "sample": [5]},
    {"op": "submit", "uid": 1, "tokens": [1, 2, 3, 4], "max_tokens": 4},
    {"op": "prefill", "budget": 64, "sample": [6]},
    {"op": "decode", "sample": [7]},
]
SMALL = SubjectConfig(num_pages=4, page_size=2, max_seq_len=8)


def preempted_at_the_full_pool(factory: Callable[[SubjectConfig], example.LazyPagingCache]):
    driver = SubjectDriver(factory(SMALL), SMALL)
    for op in TWO_ON_A_FULL_POOL:
        driver.apply(op)
    return driver.apply({"op": "decode", "sample": [8]}).preempted, driver


def test_the_subject_chosen_victim_is_the_one_preempted():
    chosen, driver = preempted_at_the_full_pool(example.build)
    assert chosen == (0,)  # the request whose allocation failed (the older one), as the subject says
    assert driver.waiting == [0] and driver.running == [1]
    newest, _ = preempted_at_the_full_pool(without("chooses_victim"))
    assert newest[0] == 1  # without the capability the driver gives up the newest, not the subject's choice


def test_a_preempted_request_resumes_on_the_pages_it_kept():
    _, driver = preempted_at_the_full_pool(example.build)
    kept = driver.view().preempted[0]
    driver.apply({"op": "finish", "uid": 1})
    driver.apply({"op": "prefill", "budget": 64, "sample": [9]})
    assert driver.view().requests[0][: len(kept)] == kept


def test_an_abort_releases_what_a_preempted_request_kept():
    _, driver = preempted_at_the_full_pool(example.build)
    driver.apply({"op": "abort", "uid": 0})
    assert driver.view().preempted == {}
    _, leaky = preempted_at_the_full_pool(example.abort_leaks_kept)
    with pytest.raises(Finding) as caught:
        leaky.apply({"op": "abort", "uid": 0})
    assert caught.value.kind == "1-2-partition"  # the kept pages' references outlive their holder
    assert "page 0 has reference count 3, but 1 live request(s) [1] hold it" in caught.value.message


@pytest.mark.parametrize(
    "bug, kinds, words",
    [
        (example.evicts_locked, {"4-failed-admission"}, "a live or preempted request holds"),
        (example.abort_leaks_kept, {"1-2-partition", "5-quiescence"}, "a leak"),
        (example.names_a_waiting_victim, {"6-preemption-order"}, "which is not a live request"),
        (example.drops_cache_ref_twice, {"1-2-partition"}, "reference count"),
    ],
)
def test_each_planted_bug_is_caught_with_its_invariant(bug, kinds, words):
    found = findings(bug)
    caught = Counter({kind: len(found[kind]) for kind in kinds if kind in found})
    assert caught, found.keys()
    assert any(words in message for kind in caught for message in found[kind])
