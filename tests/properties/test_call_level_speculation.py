"""Speculation on the call-level protocol (`properties/subject_speculation.py`): the driver proposes
drafts, writes their KV, verifies and commits the accepted run; the judge's clauses on the slots a
request holds ahead. A toy speculating block cache (below) with one planted mistake at a time
shows each clause names its bug, and that the clean toy passes seeded runs reaching every rare
state speculation has."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
from typing import Dict, List, Sequence

import pytest

from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import InvalidOp
from kvledger.properties.subject import SubjectConfig
from kvledger.properties.subject_driver import SubjectDriver
from kvledger.properties.subject_events import expected_events
from kvledger.properties.subject_workload import drain, draw_shape, next_op
from tests.support.toy_block_subject import ToyBlockCache

DRAFTS = 2  # drafts verified per step
RESERVE = 4  # positions the toy holds past its committed KV (SGLang's decode reserve)


class ToySpeculating(ToyBlockCache):
    """The toy block cache under speculation: each decode allocates up to RESERVE positions past
    the committed KV, the verified run joins the request, full blocks of committed KV are
    published. Bugs: `tail-not-freed` (a release frees only the committed blocks),
    `cache-drafts` (blocks are published up to what is allocated), `reserve-from-allocated` (each
    step allocates RESERVE past the allocation, not past the committed KV)."""

    name = "toy-spec"

    def __init__(self, config: SubjectConfig, bug: str | None = None) -> None:
        super().__init__(config, None)
        self.bug_spec = bug
        self.capabilities = dataclasses.replace(self.capabilities, spec_tokens=DRAFTS, max_ahead=RESERVE - 1)
        self.drafts: Dict[int, List[int]] = {}
        self.decoding: set = set()  # prefilled: its allocations are decode steps
        self.calls: List[tuple] = []

    def allocate(self, uid: int, start: int, end: int) -> bool:
        held = len(self.tables[uid]) * self.bs
        if uid in self.decoding:
            base = held if self.bug_spec == "reserve-from-allocated" else start
            end = max(end, base + RESERVE)
        return super().allocate(uid, start, end)

    def drafted(self, uid: int, start: int, tokens: Sequence[int]) -> None:
        assert start == len(self.tokens[uid])
        self.calls.append(("drafted", uid, start, list(tokens)))
        self.drafts[uid] = list(tokens)

    def computed(self, uid: int, start: int, end: int, token: int | None) -> None:
        drafts = self.drafts.pop(uid, None)
        if drafts is None:
            super().computed(uid, start, end, token)
            if token is not None:
                self.decoding.add(uid)
            return
        self.calls.append(("computed", uid, start, end, token))
        self.tokens[uid].extend(drafts[: end - start - 1])
        if self.bug_spec == "cache-drafts":  # publish the blocks up to the allocation, drafts and all
            written = self.tokens[uid] + drafts[end - start - 1 :]
            saved, self.tokens[uid] = self.tokens[uid], written
            super().computed(uid, start, min(len(written), len(self.tables[uid]) * self.bs), None)
            self.tokens[uid] = saved + [token]
            return
        super().computed(uid, start, end, token)

    def rejected(self, uid: int, start: int, end: int) -> None:
        self.calls.append(("rejected", uid, start, end))

    def _release(self, uid: int) -> None:
        self.decoding.discard(uid)
        if self.bug_spec == "tail-not-freed":
            keep = -(-len(self.tokens[uid]) // self.bs)
            self.tables[uid] = self.tables[uid][:keep]  # the blocks past it are never freed
        super()._release(uid)


CONFIG = SubjectConfig(num_pages=12, page_size=2, max_seq_len=16, max_running_req=4)


def driver_of(bug: str | None = None, events: set | None = None) -> SubjectDriver:
    return SubjectDriver(ToySpeculating(CONFIG, bug), CONFIG, on_event=(events.add if events is not None else None))


def test_a_decode_proposes_drafts_writes_them_and_commits_the_accepted_run():
    d = driver_of()
    d.apply({"op": "submit", "uid": 0, "tokens": [1, 2, 3], "max_tokens": 8})
    d.apply({"op": "prefill", "budget": 64, "sample": [0]})
    # sample: drafts 1, 2 then the bonus 3; one draft accepted
    d.apply({"op": "decode", "sample": [1, 2, 3], "accept": [1]})
    calls = d.subject.calls
    assert calls[0] == ("drafted", 0, 4, [1, 2])
    assert calls[1] == ("computed", 0, 3, 5, 3)  # [3, 5): the last token and the accepted draft
    assert calls[2] == ("rejected", 0, 5, 6)  # the second draft's slot
    assert d.witness.tokens[0] == [1, 2, 3, 0, 1, 3]
    assert d.witness.computed[0] == 5
    row = d.view().requests[0]
    assert len(row) == 8  # round_up(5 + RESERVE, 2): the reserve past the committed KV
    # the rejected draft's KV, at position 5, was written for [..., 1, 2], not for the bonus 3
    assert d.witness.written[row[5]][1] == 6
    assert d.witness.prefixes[d.witness.written[row[5]][0]] == (1, 2, 3, 0, 1, 2)


def test_a_bonus_equal_to_the_rejected_draft_is_bumped_and_max_tokens_cuts_the_run():
    d = driver_of()
    d.apply({"op": "submit", "uid": 0, "tokens": [1, 2, 3], "max_tokens": 2})
    d.apply({"op": "prefill", "budget": 64, "sample": [0]})
    d.apply({"op": "decode", "sample": [1, 2, 1], "accept": [2]})  # room for one token: the first draft
    assert d.subject.calls[1] == ("computed", 0, 3, 4, 1)
    assert 0 not in d.running and 0 not in d.subject.tables
    d.apply({"op": "submit", "uid": 1, "tokens": [1, 2, 3], "max_tokens": 4})
    d.apply({"op": "prefill", "budget": 64, "sample": [0]})
    d.apply({"op": "decode", "sample": [1, 2, 1], "accept": [0]})  # the bonus 1 equals the rejected draft
    assert d.witness.tokens[1][-1] == 2


def test_accept_is_refused_where_nothing_speculates():
    plain = SubjectDriver(ToyBlockCache(CONFIG), CONFIG)
    plain.apply({"op": "submit", "uid": 0, "tokens": [1, 2, 3], "max_tokens": 4})
    plain.apply({"op": "prefill", "budget": 64, "sample": [0]})
    with pytest.raises(InvalidOp):
        plain.apply({"op": "decode", "sample": [1], "accept": [1]})
    with pytest.raises(InvalidOp):
        driver_of().apply({"op": "prefill", "budget": 4, "accept": [1]})


def test_a_subject_that_does_not_speculate_never_loads_the_speculation_module():
    code = (
        "import sys\n"
        "from kvledger.properties.subject import SubjectConfig\n"
        "from kvledger.properties.subject_driver import SubjectDriver\n"
        "from tests.support.toy_block_subject import ToyBlockCache\n"
        "c = SubjectConfig(num_pages=8, page_size=2, max_seq_len=16)\n"
        "d = SubjectDriver(ToyBlockCache(c), c)\n"
        "for op in [{'op': 'submit', 'uid': 0, 'tokens': [1, 2, 3], 'max_tokens': 2},\n"
        "           {'op': 'prefill', 'budget': 64}, {'op': 'decode'}]:\n"
        "    d.apply(op)\n"
        "assert 'kvledger.properties.subject_speculation' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def run_seeded(bug: str | None, cases: int, events: set) -> Finding | None:
    """`cases` seeded cases of the fuzzer's workload (page size 2) over the toy, each drained."""
    for case in range(cases):
        rng = random.Random(case)
        shape = draw_shape(rng, (2,))
        d = SubjectDriver(ToySpeculating(shape.config, bug), shape.config, on_event=events.add)
        history: List[List[int]] = []
        uid = 0
        try:
            for _ in range(40):
                op = next_op(rng, shape, d, uid, history)
                if op is None:
                    continue
                uid += op["op"] == "submit"
                try:
                    d.apply(op)
                except InvalidOp:
                    pass
            drain(d, lambda op: d.apply(op))
        except Finding as f:
            return f
    return None


def test_the_clean_toy_passes_and_reaches_every_rare_state_of_speculation():
    events: set = set()
    assert run_seeded(None, 30, events) is None
    caps = ToySpeculating(CONFIG).capabilities
    spec = ("spec: a draft rejected", "spec: every draft accepted", "ahead: a request holds slots past its tokens")
    for event in spec:
        assert event in expected_events(caps) and event in events


@pytest.mark.parametrize(
    "bug, kind, words",
    [
        ("tail-not-freed", "11-over-allocation", "the over-allocated tail is not returned"),
        ("cache-drafts", "11-over-allocation", "the prefix cache owns committed KV only"),
        ("reserve-from-allocated", "11-over-allocation", "may hold at most"),
    ],
)
def test_each_planted_mistake_is_named(bug, kind, words):
    found = run_seeded(bug, 30, set())
    assert found is not None and found.kind == kind and words in found.message, found


def test_the_tail_clause_reads_locations_past_the_committed_positions():
    from kvledger.engine.ledger.invariants import InvariantViolation
    from kvledger.properties.subject import CachedEntry, View
    from kvledger.properties.subject_speculation import check_tail, tail_pages

    # uid 1 committed 3 positions of a row of 8 (pages 0 and 1 of size 4); the tree holds [0, 3)
    rows = {1: list(range(8)), 2: [8, 9, 10, 11]}
    cached = [CachedEntry((0, 1, 2), start=0, tokens=(5, 6, 7), lock=1, name="node 1")]
    check_tail(View(free=[], requests=rows, cached=cached), {1: 3, 2: 2})
    in_tree = [CachedEntry((0, 1, 2, 3), start=0, tokens=(5, 6, 7, 8), lock=1, name="node 1")]
    with pytest.raises(InvariantViolation, match="position 3 of its tail .* cache node 1"):
        check_tail(View(free=[], requests=rows, cached=in_tree), {1: 3, 2: 2})
    shared = {1: list(range(8)), 2: [8, 9, 10, 11, 4, 5, 6, 7]}
    with pytest.raises(InvariantViolation, match=r"location 4, which uids \[2\] hold too"):
        check_tail(View(free=[], requests=shared), {1: 3, 2: 2})
    # the tail's pages: past the page holding the last committed position
    assert tail_pages(list(range(12)), 3, 4) == [1, 2]
    assert tail_pages(list(range(12)), 4, 4) == [1, 2]
    assert tail_pages(list(range(8)), 8, 4) == []
