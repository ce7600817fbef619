"""The subject-independent judge, clause by clause, and the judge-mode driver around it.

Each judge test breaks one thing in an otherwise sound view and checks the judge names it; the
driver tests plant one bug in a small block cache (tests/support/toy_block_subject.py) and check
the finding, its kind and that the fuzzer and minimizer turn it into a short trace."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvledger.engine.ledger.invariants import InvariantViolation
from kvledger.engine.ledger.subject import Capabilities, CachedEntry, SubjectConfig, View
from kvledger.engine.ledger.subject_judge import Ledger, check_queue_order, judge
from kvledger.properties.subject_driver import SubjectDriver, replay

sys.path.insert(0, str(Path(__file__).parent / "support"))
from toy_block_subject import ToyBlockCache  # noqa: E402

RADIX = Capabilities(page_size=2, pages=tuple(range(6)), worst_case_admission=True, preempts=False,
                     explicit_evict=True, cached_pages_in_free_pool=False)
BLOCKS = replace(RADIX, worst_case_admission=False, preempts=True, cached_pages_in_free_pool=True)


def sound():
    """uid 1 read [5, 6, 7] (cached as pages 0-1, locked) and wrote [8]; page 2 is its own; 3-5 free."""
    ledger = Ledger()
    ledger.tokens[1] = [5, 6, 7, 8, 9]
    ledger.prompt_len[1] = 4
    ledger.computed[1] = 4
    ledger.wrote([0, 1, 2, 3], [5, 6, 7, 8], 0)
    view = View(free=[3, 4, 5], requests={1: [0, 1, 2, 3, 4]},
                cached=[CachedEntry((0, 1, 2, 3), 0, tokens=(5, 6, 7, 8), lock=1, name="node 1")],
                counters={"free_pages": 3, "evictable_tokens": 0, "protected_tokens": 4})
    return view, ledger


def verdict(view, ledger, caps=RADIX, subject=None):
    try:
        judge(view, caps, ledger, subject)
    except InvariantViolation as e:
        return e.invariant, str(e)
    return None


def test_a_sound_view_passes():
    assert verdict(*sound()) is None


@pytest.mark.parametrize("change, invariant, words", [
    (lambda v, l: v.free.remove(5), "1-2-partition", "page 5 is owned by nobody"),
    (lambda v, l: v.free.append(4), "1-2-partition", "page 4 is in the free list twice"),
    (lambda v, l: v.free.append(2), "1-2-partition", "page 2 is free, but live uid(s) [1] hold it"),
    (lambda v, l: v.free.append(0), "1-2-partition", "page 0 is free, but live uid(s) [1]"),
    (lambda v, l: v.free.append(9), "1-2-partition", "holds 9, not a page of the pool"),
    (lambda v, l: v.requests.__setitem__(1, [0, 1, 2, 5, 4]), "1-2-partition", "position 3 is at location 5"),
    (lambda v, l: v.cached.__setitem__(0, replace(v.cached[0], lock=2)), "1-2-partition", "lock count 2"),
    (lambda v, l: v.counters.__setitem__("free_pages", 4), "9-counters", "free_pages = 4"),
    (lambda v, l: v.counters.__setitem__("protected_tokens", 2), "9-counters", "protected_tokens = 2"),
    (lambda v, l: l.written.__setitem__(2, l.written[3]), "7-kv-provenance", "uid 1: position 2 reads location 2"),
    (lambda v, l: l.written.pop(1), "7-kv-provenance", "was never computed"),
    (lambda v, l: l.computed.__setitem__(2, 0), "8-request", "live uids [2] are missing"),
    (lambda v, l: l.computed.__setitem__(1, 6), "8-request", "computed 6 positions but holds locations for 5"),
])
def test_each_clause_names_what_broke(change, invariant, words):
    view, ledger = sound()
    change(view, ledger)
    found = verdict(view, ledger)
    assert found is not None and found[0] == invariant and words in found[1], found


def test_a_cached_entry_must_hold_kv_of_the_tokens_it_claims():
    view, ledger = sound()
    view.cached[0] = replace(view.cached[0], tokens=(5, 6, 7, 0))
    assert verdict(view, ledger)[0] == "7-kv-provenance"


def test_pages_two_requests_share_must_be_cached_at_the_same_positions():
    view, ledger = sound()
    ledger.tokens[2], ledger.prompt_len[2], ledger.computed[2] = [5, 6, 7, 8, 1], 5, 2
    view.requests[2] = [0, 1, 10, 11]  # shares page 0 (positions 0-1) with uid 1, owns page 5
    view.free, view.counters = [3, 4], {}
    view.cached = [CachedEntry((0, 1), 0, tokens=(5, 6), lock=1, name="node 1"),
                   CachedEntry((2, 3), 2, tokens=(5, 6, 7, 8), lock=1, name="node 2")]
    assert "node 1 (positions [0, 2)) has lock count 1, but 2" in verdict(view, ledger)[1]
    view.cached[0] = replace(view.cached[0], lock=2)
    assert verdict(view, ledger) is None
    view.cached = []
    view.free = [3, 4, 1]
    found = verdict(view, ledger)
    assert found[0] == "1-2-partition" and "page 0 is held by uids [1, 2] but not cached" in found[1]
    view.requests[2] = [10, 11, 0, 1]
    view.cached = [CachedEntry((0, 1), 0, tokens=(5, 6), lock=1), CachedEntry((2, 3), 2, tokens=(5, 6, 7, 8), lock=1)]
    view.free = [3, 4]
    found = verdict(view, ledger)
    assert "held by uids [1, 2] at different positions [0, 2]" in found[1] or "lock count" in found[1], found


def test_quiescence_no_lock_without_a_live_request():
    view, ledger = sound()
    ledger.computed.clear()
    view.requests.clear()
    view.free = [2, 3, 4, 5]
    view.counters = {"free_pages": 4}
    assert verdict(view, ledger)[0] == "5-quiescence"
    view.cached[0] = replace(view.cached[0], lock=0)
    assert verdict(view, ledger) is None


def test_a_hash_chained_key_is_recomputed_with_the_subjects_own_function():
    class Keys:
        def cache_key(self, tokens):
            return ("key", tuple(tokens))

    view, ledger = sound()
    view.cached = [CachedEntry((0, 1), None, key=("key", (5, 6)), name="block 0"),
                   CachedEntry((2, 3), None, key=("key", (5, 6, 7, 8)), name="block 1")]
    view.page_refs = {p: (1 if p < 3 else 0) for p in range(6)}
    view.counters = {"free_pages": 3}
    assert verdict(view, ledger, BLOCKS, Keys()) is None
    view.cached[1] = replace(view.cached[1], key=("key", (7, 8)))  # chained from the wrong parent
    found = verdict(view, ledger, BLOCKS, Keys())
    assert found[0] == "7-kv-provenance" and "a hit there reads KV of another prefix" in found[1]
    view.page_refs[0] = 2
    assert "reference count 2" in verdict(view, ledger, BLOCKS, Keys())[1]


def test_queue_order_first_come_first_served_and_preempted_ahead():
    arrival = {1: 0, 2: 1, 3: 2}
    check_queue_order([1, 2, 3], arrival, {}, set())
    with pytest.raises(InvariantViolation, match="not in arrival order"):
        check_queue_order([2, 1], arrival, {}, set())
    check_queue_order([3, 1, 2], arrival, {3: 0}, {3})
    with pytest.raises(InvariantViolation, match="waits behind uid 1, which was never admitted"):
        check_queue_order([1, 3, 2], arrival, {3: 0}, {3})


# -- the driver ----------------------------------------------------------------------------------
CONFIG = SubjectConfig(num_pages=8, page_size=2, max_seq_len=16, max_running=4)


def run(bug, ops):
    return replay(lambda config: ToyBlockCache(config, bug), CONFIG, ops)[0]


SHARED = [{"op": "submit", "uid": 0, "tokens": [1, 2, 3, 4, 5], "max_tokens": 2},
          {"op": "prefill", "budget": 64, "sample": [7]},
          {"op": "submit", "uid": 1, "tokens": [1, 2, 3, 4, 6], "max_tokens": 2},
          {"op": "prefill", "budget": 64, "sample": [7]},
          {"op": "decode", "sample": [7]}]


def test_the_sound_toy_keeps_every_invariant():
    assert run(None, SHARED + [{"op": "submit", "uid": 2, "tokens": [1, 2], "max_tokens": 1},
                               {"op": "prefill", "budget": 64}]) is None


@pytest.mark.parametrize("bug, kind", [
    ("leak-on-release", "1-2-partition"),
    ("hit-skips-ref", "1-2-partition"),
    ("key-forgets-parent", "7-kv-provenance"),
])
def test_a_planted_bug_is_a_finding_of_its_kind(bug, kind):
    finding = run(bug, SHARED)
    assert finding is not None and finding.kind == kind, finding


def test_a_hit_covering_the_last_prompt_token_is_named():
    ops = [{"op": "submit", "uid": 0, "tokens": [1, 2, 3, 4], "max_tokens": 1}, {"op": "prefill", "budget": 64},
           {"op": "submit", "uid": 1, "tokens": [1, 2, 3, 4], "max_tokens": 1}, {"op": "prefill", "budget": 64}]
    assert run(None, ops) is None
    finding = run("hit-covers-last-token", ops)
    assert finding.kind == "8-request" and "leave the last prompt token" in finding.message


def test_an_exception_inside_the_subject_is_a_finding_with_its_traceback():
    ops = SHARED[:1] + [{"op": "abort", "uid": 0}]
    finding = run("abort-raises", ops)
    assert finding.kind == "subject-raised:KeyError"
    assert "toy_block_subject.py" in finding.detail and "in abort" in finding.detail


def test_worst_case_promise_broken_is_3_no_oom():
    class Overbooks(ToyBlockCache):
        def __init__(self, config):
            super().__init__(config)
            self.capabilities = replace(self.capabilities, worst_case_admission=True, preempts=False)

    ops = [{"op": "submit", "uid": u, "tokens": [u, u, u, u, u], "max_tokens": 8} for u in range(3)]
    ops += [{"op": "prefill", "budget": 64}] + [{"op": "decode"}] * 8
    finding, _ = replay(Overbooks, SubjectConfig(num_pages=12, page_size=2, max_seq_len=16), ops)
    assert finding.kind == "3-no-oom"


def test_a_preempted_request_waits_again_at_the_head_and_finishes():
    config = SubjectConfig(num_pages=4, page_size=2, max_seq_len=8)
    driver = SubjectDriver(ToyBlockCache(config), config)
    driver.apply({"op": "submit", "uid": 0, "tokens": [1, 2, 3], "max_tokens": 4})
    driver.apply({"op": "submit", "uid": 1, "tokens": [4, 5, 6], "max_tokens": 4})
    driver.apply({"op": "prefill", "budget": 64})
    driver.apply({"op": "decode"})  # position 3: in the requests' second blocks
    assert driver.running == [0, 1]
    driver.apply({"op": "decode"})  # position 4 needs a block: the newest request gives its up
    assert driver.waiting == [1] and driver.running == [0] and 1 in driver.preempted
    for _ in range(8):
        driver.apply({"op": "decode"} if driver.running else {"op": "prefill", "budget": 64})
    assert not driver.waiting and not driver.running


def test_fuzz_and_minimize_a_users_subject(tmp_path, monkeypatch, capsys):
    from kvledger.cli import main

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "support"))
    code = main(["fuzz", "--subject", "toy_block_subject:leaky", "--seconds", "60", "--max-cases", "5",
                 "--out-dir", str(tmp_path), "--minimize-replays", "200"])
    out = capsys.readouterr().out
    assert code == 1 and "FOUND [1-2-partition]" in out and "a leak" in out
    small = sorted(tmp_path.glob("*.min.jsonl"))
    assert small
    from kvledger.engine.ledger import trace

    header, ops = trace.read(small[0])
    assert header.subject == "toy_block_subject:leaky" and len(ops) <= 4
    assert main(["replay", str(small[0])]) == 1
    assert main(["replay", str(small[0]), "--subject", "toy_block_subject:factory"]) == 0
