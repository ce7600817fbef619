"""sglang:paged: SGLang 0.5.23's decode memory check and retract_decode at page size > 1, and a
chunked prefill aborted after its checkpoint, driven by kvledger's driver.

Needs the installed sglang (the `# sglang` section of subjects-constraints.txt); skips without it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List

import pytest

from kvledger.engine.ledger.ops import Decode
from kvledger.engine.ledger.trace import read
from kvledger.properties.subject import SubjectConfig
from kvledger.properties.subject_driver import SubjectDriver, drive
from kvledger.properties.subject_events import ABORT_AFTER_CHECKPOINT, EXHAUSTED_AT_DECODE, expected_events
from kvledger.properties.subject_workload import drain
from kvledger.properties.target import config_of
from kvledger.subjects import parse_spec, sglang, sglang_paged
from kvledger.subjects.edits import edited_function

P = list(range(1, 9))  # two full pages at page size 4
Q = list(range(11, 19))


pytestmark = pytest.mark.usefixtures("sglang_importable")


def _submit(uid: int, tokens: List[int], max_tokens: int) -> Dict[str, Any]:
    return {"op": "submit", "uid": uid, "tokens": tokens, "max_tokens": max_tokens}


def _prefill(budget: int = 64) -> Dict[str, Any]:
    return {"op": "prefill", "budget": budget}


DECODE: Dict[str, Any] = {"op": "decode"}


def test_the_spec_builds_the_default_tree_with_its_knobs_and_page_size():
    spec = parse_spec("sglang:paged")
    assert spec.page_sizes() == (2, 4) and spec.zoo() == sglang_paged.ZOO
    s = sglang_paged.build(SubjectConfig(num_pages=6, page_size=4, max_seq_len=32))
    assert s.name == "sglang:paged" and type(s.tree).__name__ == "UnifiedRadixCache"
    assert s.capabilities.chooses_victim and s.capabilities.preempts
    # the knobs as the scheduler reads them at start; the process environment is left as it was
    assert s.scheduler.ratio.current == pytest.approx(0.05) and s.scheduler.clip == 2
    assert "SGLANG_INIT_NEW_TOKEN_RATIO" not in os.environ
    assert sglang.build(SubjectConfig(num_pages=6, page_size=4, max_seq_len=32)).scheduler.clip == 4096
    with pytest.raises(ValueError, match="page size >= 2"):
        sglang_paged.build(SubjectConfig(num_pages=6, page_size=1, max_seq_len=32))
    expected = expected_events(s.capabilities)
    assert {EXHAUSTED_AT_DECODE, ABORT_AFTER_CHECKPOINT} <= expected


def test_a_decode_on_an_exhausted_pool_retracts_in_sglangs_order():
    """Two 8-token requests of up to 8 tokens in 6 pages: both admitted (each charged 2 decode
    tokens), their fourth pages wanted at position 12 with none free or evictable: check_decode_mem
    fails, retract_decode releases the newest of two equal ones, the scheduler keeps its ratio."""
    config = SubjectConfig(num_pages=6, page_size=4, max_seq_len=32)
    s = sglang_paged.build(config)
    events: List[str] = []
    driver = SubjectDriver(s, config, on_event=events.append)
    for op in (_submit(1, P, 8), _submit(2, Q, 8), _prefill(), _prefill()):
        driver.apply(op)
    assert driver.running == [1, 2]
    for _ in range(4):  # positions 8..11: a third page each, then the pool is full
        assert driver.apply(DECODE).batch == (1, 2)
    assert s.view().free == [] and EXHAUSTED_AT_DECODE not in events
    out = driver.apply(DECODE)
    assert EXHAUSTED_AT_DECODE in events and out.preempted == (2,) and out.batch == (1,)
    # release_req: its pages freed without a checkpoint, then 20 tokens' worth evicted for uid 1
    assert len(s.view().free) == 2 and 2 not in s.view().requests
    req = s.requests[2].req
    assert s.requests[2].phase == "waiting" and req.is_retracted and len(req.output_ids) == 5
    # estimate_new_token_ratio_after_retract over uid 1: (5 decoded + 20) / (8 + 1), at most 1
    assert s.scheduler.ratio.current == 1.0
    while driver.running:
        driver.apply(DECODE)
    driver.apply(_prefill())  # readmitted from prompt + output, after uid 1 finished
    assert driver.running == [2] and len(s.requests[2].req.full_untruncated_fill_ids) == 13


def test_the_victims_are_named_in_retract_decodes_order():
    """Three 8-token requests in 10 pages, the third admitted a decode step after the first two: when
    the first two need their fourth pages, retract_decode pops the one with the fewest outputs (the
    third), and the driver is told of exactly that victim."""
    config = SubjectConfig(num_pages=10, page_size=4, max_seq_len=32)
    s = sglang_paged.build(config)
    driver = SubjectDriver(s, config)
    for op in (_submit(1, P, 8), _submit(2, Q, 8), _prefill(), _prefill(), DECODE):
        driver.apply(op)
    driver.apply(_submit(3, list(range(21, 29)), 8))
    driver.apply(_prefill())
    assert driver.running == [1, 2, 3]
    outputs = {u: len(s.requests[u].req.output_ids) for u in (1, 2, 3)}
    preempted: List[int] = []
    while not preempted and driver.running:
        preempted = list(driver.apply(DECODE).preempted or ())
    assert preempted == [3] and min(outputs, key=lambda u: outputs[u]) == 3, (preempted, outputs)
    assert s.requests[3].phase == "waiting" and driver.running == [1, 2]


def test_a_request_retracted_with_the_one_whose_allocation_ran_the_check_is_named_next():
    """retract_decode can release the request whose allocation ran the memory check and a later one
    of the batch at once; the driver, told of the first, goes on to allocate the second, which the
    subject must refuse (and name as the victim), not meet as a request it no longer runs. Found
    by a 30-minute sglang:paged hunt (case 3621, minimized to these 9 operations): it used to raise
    DriverMismatch "allocate while retracted"."""
    config = SubjectConfig(num_pages=14, page_size=4, max_seq_len=48, max_running_req=8)
    s = sglang_paged.build(config)
    driver = SubjectDriver(s, config)
    a, b = [0, 2, 2, 1, 0, 1, 1, 1, 1, 3, 2, 2, 1, 1, 0, 3], [1, 0, 3, 3, 0, 3, 2, 2]
    c, d = [1, 0, 3, 3, 0, 1, 3, 0, 0, 2, 1, 3], [3, 0, 0, 2, 1, 0, 0, 0, 1, 3, 2, 3]
    for op in (_submit(0, a, 2), _submit(1, b, 2), _submit(2, c, 2), _submit(3, a, 2), _submit(4, d, 2)):
        driver.apply(op)
    for _ in range(3):
        driver.apply({"op": "prefill", "budget": 64, "sample": [1]})
    out = driver.apply({"op": "decode", "sample": [1]})
    assert len(out.preempted or ()) >= 2  # two released by one retract_decode, both named
    assert all(s.requests[u].phase == "waiting" for u in out.preempted or ())


def test_a_chunk_is_checkpointed_at_the_next_step_and_an_abort_frees_the_last_one():
    config = SubjectConfig(num_pages=8, page_size=4, max_seq_len=32)
    s = sglang_paged.build(config)
    events: List[str] = []
    driver = SubjectDriver(s, config, on_event=events.append)
    prompt = list(range(1, 13))
    driver.apply(_submit(1, prompt, 2))
    driver.apply(_prefill(5))  # [0, 5): computed, not stashed yet
    assert s.view().cached == [] and s.chunk_to_stash == 1
    driver.apply(_prefill(4))  # the step's top stashes [0, 5) (its page [0, 4)); [5, 9) computed
    assert [e.tokens for e in s.view().cached] == [tuple(prompt[:4])] and s.chunk_to_stash == 1
    driver.apply({"op": "abort", "uid": 1})
    assert "abort: mid-prefill" in events and ABORT_AFTER_CHECKPOINT in events
    view = s.view()
    # process_pending_chunked_abort before the stash: [5, 9) never filed, its pages freed; the
    # page the first stash filed stays cached, unlocked
    assert view.requests == {} and [(e.tokens, e.lock) for e in view.cached] == [(tuple(prompt[:4]), 0)]
    assert len(view.free) == 7 and s.chunk_to_stash is None


# each zoo entry's failing trace, as `kvledger zoo --subject sglang:paged` found and minimized it
TRACES = Path(__file__).parent / "sglang_zoo_traces"
KINDS = {
    "sglang-paged-decode-need-off-by-one": "subject-raised:RuntimeError",  # SGLang's 'Decode out of memory'
    "sglang-paged-retract-one-only": "subject-raised:RuntimeError",
    "sglang-paged-alloc-decode-keeps-pages-free": "1-2-partition",
    "sglang-paged-alloc-decode-strict-fit": "subject-raised:RuntimeError",
    "sglang-paged-decode-need-in-pages": "subject-raised:RuntimeError",
}


def test_the_zoo_applies_to_the_installed_version():
    names = [e.name for e in sglang_paged.ZOO]
    assert len(names) >= 5 and len(set(names)) == len(names) and set(names) == set(KINDS)
    assert {p.stem for p in TRACES.glob("sglang-paged-*.jsonl")} == set(KINDS)
    for edit in sglang_paged.ZOO:
        edited_function(edit)


@pytest.mark.parametrize("edit", sglang_paged.ZOO, ids=lambda e: e.name)
def test_zoo_entry_is_caught_on_its_trace_and_the_clean_subject_passes(edit):
    header, ops = read(TRACES / f"{edit.name}.jsonl")
    assert header.subject == "sglang:paged"
    config = config_of(header)
    finding, _ = drive(sglang_paged.build(config, edits=[edit]), config, ops)
    assert finding is not None and finding.kind == KINDS[edit.name], f"{edit.name}: {finding}"
    clean, driver = drive(sglang_paged.build(config), config, ops)
    assert clean is None, f"{edit.name}: the unedited subject fails the same trace: {clean}"
    assert driver.ops == len(ops)


def test_a_request_retracted_after_a_hit_admission_may_wait_on_an_idle_pool():
    """A 30-minute hunt's liveness lead: uid 10 (19 prompt tokens, up to 8 new) was admitted on a
    12-token hit of pages others held and retracted after 5 outputs. Alone on the idle 28-token pool
    it asks PrefillAdder for 24 + 3 + a page = 31 tokens: SGLang never takes it, by its own margin,
    so the drain's liveness rule does not judge it (it once fit only on a hit); a request that
    once fit with no hit still is (tests/properties/test_drain_liveness.py)."""
    header, ops = read(Path(__file__).parent / "sglang_paged_traces" / "retracted-after-a-hit-admission.jsonl")
    config = config_of(header)
    finding, driver = drive(sglang_paged.build(config), config, ops)
    assert finding is None and 10 in driver.preempted and driver.waiting[0] == 10
    assert driver.hits[10] > 0 and 10 not in driver.fit_alone
    drain(driver, driver.apply)  # no liveness finding
    assert driver.waiting and driver.waiting[0] == 10 and not driver.running


def test_the_last_request_retract_decode_aborts_resumes_without_its_abort():
    """Issue 36's lead, hand-built (fuzzing never reached it: 137 retract_decode calls in 1,371 cases
    of seed 0, none aborting): uid 1 decodes alone while uid 2, mid-prefill, holds the rest of the
    pool, so at its fourth page even the last request does not fit and retract_decode ends it
    (reqs_to_abort, to_finish = FINISH_ABORT). The driver requeues it as a retraction; resumed, its
    prefill must not be finished by that abort: it is checkpointed into the tree, and uid 3, sharing
    its resumed prompt, hits its three full pages (it hit one, the first admission's, while the
    abort was kept: the request decoded on marked finished, its resumed pages unpublished)."""
    header, ops = read(Path(__file__).parent / "sglang_paged_traces" / "last-request-aborted-requeued.jsonl")
    config = config_of(header)
    s = sglang_paged.build(config)
    events: List[str] = []
    driver = SubjectDriver(s, config, on_event=events.append)
    aborted = resumed = 0
    for op in ops:
        alone = driver.running == [1]
        out = driver.apply(op)
        if alone and isinstance(op.op, Decode) and out.preempted == (1,):
            aborted += 1  # retract_decode always keeps one request: it aborted the only one
            assert s.requests[1].phase == "waiting" and s.requests[1].req.to_finish is None
        r = s.requests.get(1)
        if r is not None and r.phase == "running" and r.req.retraction_count == 1:
            resumed += 1
            assert not r.req.finished(), r.req.finished_reason
    assert aborted == 1 and resumed >= 2 and EXHAUSTED_AT_DECODE in events
    assert driver.hits[3] == 12 and not s.requests and not driver.live
    finding, _ = drive(sglang_paged.build(config), config, ops)
    assert finding is None, finding
