"""The call-level driver's side of the misfits: what a refused admission of a subject that evicts
before it admits may change (`subject_state_diff.eviction_breach`), and where the victims a
subject chooses wait again. Views are hand-built in the shapes real managers show."""

from __future__ import annotations

import dataclasses
from typing import List

import pytest

from kvledger.engine.ledger.finding import Finding
from kvledger.properties.subject import CachedEntry, SubjectConfig, View
from kvledger.properties.subject_driver import SubjectDriver
from kvledger.properties.subject_state_diff import eviction_breach, refusal_finding
from tests.support.toy_block_subject import ToyBlockCache

PS = 2


def block(page: int, key: tuple, lock: int | None = None) -> CachedEntry:
    return CachedEntry((page * PS, page * PS + 1), start=None, key=key, lock=lock, name=f"block {page}")


def before() -> View:
    """Page 0 held by uid 1 and cached; page 1 cached, nobody holds it; page 2 kept by a
    preempted uid 2 and cached; page 3 free. The map holds a reference of its own."""
    return View(
        free=[3],
        requests={1: [0, 1]},
        cached=[block(0, (1, 2)), block(1, (1, 2, 3, 4)), block(2, (5, 6))],
        page_refs={0: 2, 1: 1, 2: 2, 3: 0},
        counters={"free_pages": 1},
        preempted={2: [4, 5]},
    )


def evicted(**change) -> View:
    """`before` after evicting page 1 (the only page nobody holds), then `change`."""
    view = dataclasses.replace(
        before(), free=[3, 1], cached=[block(0, (1, 2)), block(2, (5, 6))], page_refs={0: 2, 1: 0, 2: 2, 3: 0}
    )
    return dataclasses.replace(view, **change)


def test_evicting_what_nobody_holds_is_the_change_allowed():
    assert eviction_breach(before(), evicted(counters={"free_pages": 2}), PS) is None


@pytest.mark.parametrize(
    "after, words",
    [
        (evicted(cached=[block(2, (5, 6))], page_refs={0: 1, 1: 0, 2: 2, 3: 0}), "a live or preempted request holds"),
        (evicted(cached=[block(0, (1, 2))], page_refs={0: 2, 1: 0, 2: 1, 3: 0}), "a live or preempted request holds"),
        (evicted(free=[1]), "pages left the free list: 3"),
        (evicted(free=[3, 1, 2]), "not evicted: 2"),
        (evicted(requests={1: [0, 1, 6, 7]}), "rows changed"),
        (evicted(preempted={}), "preempted requests' pages changed"),
        (evicted(page_refs={0: 3, 1: 0, 2: 2, 3: 0}), "page refs changed on pages not evicted"),
        (dataclasses.replace(before(), cached=[block(0, (1, 2)), block(1, (9, 9)), block(2, (5, 6))]), "added"),
    ],
)
def test_anything_else_a_refusal_changes_is_named(after, words):
    breach = eviction_breach(before(), after, PS)
    assert breach is not None and words in breach


def test_a_locked_entry_is_never_evicted_by_a_refusal():
    locked = dataclasses.replace(before(), cached=[block(1, (1, 2, 3, 4), lock=1)], page_refs=None)
    after = dataclasses.replace(locked, cached=[], free=[3, 1])
    breach = eviction_breach(locked, after, PS)
    assert breach is not None and "locked" in breach


def test_the_capability_decides_whether_the_eviction_is_a_finding():
    caps = ToyBlockCache(SubjectConfig(num_pages=4, page_size=PS, max_seq_len=8)).capabilities
    plain = refusal_finding(7, before(), evicted(), caps)
    assert isinstance(plain, Finding) and plain.kind == "4-failed-admission"
    assert "refusing uid 7 changed the subject's state" in plain.message and "cached entries removed" in plain.message
    declared = dataclasses.replace(caps, evicts_before_admit=True)
    assert refusal_finding(7, before(), evicted(), declared) is None
    beyond = refusal_finding(7, before(), evicted(free=[1]), declared)
    assert beyond is not None and "changed more than evicting" in beyond.message


class GivesUpTheOldest(ToyBlockCache):
    """A block cache whose scheduler preempts its oldest running request."""

    def __init__(self, config: SubjectConfig) -> None:
        super().__init__(config)
        self.capabilities = dataclasses.replace(self.capabilities, chooses_victim=True)

    def victim(self, uid: int) -> int:
        return min(self.tables)


def three_running(factory) -> SubjectDriver:
    """Three running requests of two tokens share their first page, on a pool of 4 one-token
    pages: full, and each decode needs a page per request."""
    config = SubjectConfig(num_pages=4, page_size=1, max_seq_len=5)
    driver = SubjectDriver(factory(config), config)
    for uid in range(3):
        driver.apply({"op": "submit", "uid": uid, "tokens": [1, 2 + uid], "max_tokens": 3})
        driver.apply({"op": "prefill", "budget": 64, "sample": [2]})
    return driver


def test_chosen_victims_wait_again_in_the_order_they_were_admitted():
    driver = three_running(GivesUpTheOldest)
    result = driver.apply({"op": "decode", "sample": [3]})
    # the subject's order: uid 0 gives itself up, then uid 2's allocation costs uid 1
    assert result.preempted == (0, 1)
    assert driver.waiting == [0, 1]  # the one admitted first resumes first
    assert driver.running == [2]


def test_a_victim_that_is_not_live_is_a_finding():
    class NamesAStranger(GivesUpTheOldest):
        def victim(self, uid: int) -> int:
            return 99

    driver = three_running(NamesAStranger)
    with pytest.raises(Finding) as caught:
        driver.apply({"op": "decode", "sample": [3]})
    assert caught.value.kind == "6-preemption-order" and "uid 99" in caught.value.message


def test_without_the_capability_the_newest_is_given_up():
    driver = three_running(ToyBlockCache)
    victims: List[int] = list(driver.apply({"op": "decode", "sample": [3]}).preempted or ())
    assert victims == [2, 1] and driver.waiting == [1, 2]


def test_where_the_cache_holds_a_reference_its_own_lock_is_not_a_users():
    radix = dataclasses.replace(before(), cached=[block(1, (1, 2, 3, 4), lock=1)], page_refs=None)
    after = dataclasses.replace(radix, cached=[], free=[3, 1])
    assert eviction_breach(radix, after, PS, own=1) is None
    held = dataclasses.replace(radix, cached=[block(1, (1, 2, 3, 4), lock=2)])
    breach = eviction_breach(held, after, PS, own=1)
    assert breach is not None and "lock 2" in breach


def test_a_refusal_that_touches_a_preempted_requests_pages_says_so():
    caps = ToyBlockCache(SubjectConfig(num_pages=4, page_size=PS, max_seq_len=8)).capabilities
    declared = dataclasses.replace(caps, evicts_before_admit=True, preempt_keeps_pages=True)
    for capabilities in (caps, declared):
        finding = refusal_finding(7, before(), dataclasses.replace(before(), preempted={2: [4, 5, 6, 7]}), capabilities)
        assert finding is not None and "preempted requests' pages changed (uid: before -> after): 2:" in finding.message
