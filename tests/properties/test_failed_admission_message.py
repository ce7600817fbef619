"""The `4-failed-admission` finding names what a refused admission changed (issue 35, item 6):
a subject that evicts cached prefixes before deciding, and keeps the eviction when it refuses."""

from __future__ import annotations

from kvledger.properties.subject import View
from kvledger.properties.subject_state_diff import describe_change
from tests.properties.test_subject_driver import CONFIG, replay_on
from tests.support.toy_block_subject import ToyBlockCache


class EvictsThenRefuses(ToyBlockCache):
    """Drops every unreferenced cached block's key before deciding, and keeps that when it refuses."""

    def admit(self, uid: int, budget: int) -> int | None:
        for block, key in enumerate(self.key):
            if key is not None and self.ref[block] == 0:
                del self.index[key]
                self.key[block] = None
        return super().admit(uid, budget)


OPS = [
    {"op": "submit", "uid": 1, "tokens": [9, 9, 9, 9, 9], "max_tokens": 2},
    {"op": "prefill", "budget": 64, "sample": [7]},
    {"op": "submit", "uid": 0, "tokens": [1, 2, 3, 4, 5], "max_tokens": 1},
    {"op": "prefill", "budget": 64, "sample": [7]},
    {"op": "submit", "uid": 2, "tokens": list(range(20, 32)), "max_tokens": 2},
    {"op": "prefill", "budget": 64, "sample": [7]},
]


def test_the_finding_names_the_evicted_locations():
    finding = replay_on(lambda config: EvictsThenRefuses(config), CONFIG, OPS)[0]
    assert finding is not None and finding.kind == "4-failed-admission", finding
    # uid 0 finished and left its full pages cached, unreferenced: blocks 3 and 4, positions 6-7 and 8-9
    assert "cached entries removed (locations[, lock]): [6, 7], [8, 9]" in finding.message, finding.message
    assert "free list" not in finding.message and "rows changed" not in finding.message


def test_the_sound_toy_refuses_without_a_finding():
    assert replay_on(lambda config: ToyBlockCache(config), CONFIG, OPS)[0] is None


def test_each_kind_of_change_is_named_and_capped():
    before = View(free=list(range(8)), requests={0: [0, 1]}, page_refs={0: 1}, counters={"free_pages": 8})
    after = View(free=[7], requests={0: [0, 1, 2]}, page_refs={0: 2}, counters={"free_pages": 1})
    message = describe_change(before, after)
    assert "pages left the free list: 0, 1, 2, 3, 4 (+2 more)" in message
    assert "rows changed (uid: before -> after): 0: [0, 1] -> [0, 1, 2]" in message
    assert "page refs changed (page: before -> after): 0: 1 -> 2" in message
    assert "counters changed: free_pages: 8 -> 1" in message
    assert "joined" not in message
