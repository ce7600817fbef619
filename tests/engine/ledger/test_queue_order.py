"""10-queue-order judged in full: requests never admitted wait in arrival order behind those
admitted before; with the resume order "admission" (kvledger's own scheduler, vLLM's FCFS) a
request mid-prefill waits ahead of those waiting again, and those wait in the order they were
first admitted (their arrival order). The clause on hand-made queues, on the real cache scheduler
(a request resumed and preempted again goes back ahead of one whose latest admission is older),
and the zoo bug that requeues a step's victims oldest first, caught by a trace and by the fuzzer."""

from __future__ import annotations

import math

import pytest

from kvledger import fast, reference
from kvledger.checker.fuzz import fuzz
from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.engine.ledger.invariants import InvariantViolation, check_queue_order
from kvledger.engine.ledger.trace import Header, read
from kvledger.properties.lockstep import Finding, Lockstep, replay
from kvledger.subjects.fast_zoo import BUGS, patched
from tests.support.paths import ZOO_TRACES

BUG = "requeue-victims-reversed"
KIND = "reference-invariant:10-queue-order"  # both sides run the bug; the reference is judged first
CASES = 4  # seed 1 under optimistic admission catches the bug in its first case
ARRIVAL = {uid: uid for uid in range(8)}  # uid i arrived i-th


def _violation(*args, **kw) -> str:
    with pytest.raises(InvariantViolation) as e:
        check_queue_order(*args, **kw)
    assert e.value.invariant == "10-queue-order"
    return str(e.value)


def test_requests_waiting_again_in_reversed_order_fail_and_the_message_names_them():
    # uids 1 and 2 waiting again (latest admissions #1 and #2), 2 ahead of 1; uid 5 never admitted
    message = _violation([2, 1, 5], ARRIVAL, {1: 1, 2: 2}, {1, 2})
    assert "uid 2 (arrival #2, latest admission #2) waits again at place 0" in message
    assert "ahead of uid 1 (arrival #1, latest admission #1) at place 1" in message


def test_the_promised_order_passes():
    check_queue_order([1, 2, 5, 6], ARRIVAL, {1: 1, 2: 2}, {1, 2})
    # the order is the first admission's, not the latest: uid 1 resumed (#4) and preempted again
    check_queue_order([1, 2, 5], ARRIVAL, {1: 4, 2: 2}, {1, 2})


def test_a_request_mid_prefill_waits_at_the_head():
    # uid 3 admitted and mid-prefill (live), ahead of uids 1 and 2 waiting again: kvledger keeps
    # it at the head, vLLM schedules it first among its running requests
    check_queue_order([3, 1, 2, 5], ARRIVAL, {1: 1, 2: 2, 3: 3}, {1, 2}, {3})
    message = _violation([1, 3, 2, 5], ARRIVAL, {1: 1, 2: 2, 3: 3}, {1, 2}, {3})
    assert "uid 3, admitted and mid-prefill, waits at place 1 behind uid 1" in message


def test_resume_order_any_leaves_the_requests_admitted_before_alone():
    check_queue_order([2, 1, 5], ARRIVAL, {1: 1, 2: 2}, {1, 2}, resume_order="any")
    check_queue_order([1, 3, 2, 5], ARRIVAL, {1: 1, 2: 2, 3: 3}, {1, 2}, {3}, resume_order="any")
    # the old clauses still hold under "any"
    assert "never admitted" in _violation([1, 6, 5], ARRIVAL, {1: 1}, {1}, resume_order="any")
    assert "waits behind uid 5" in _violation([5, 2, 1], ARRIVAL, {1: 1, 2: 2}, {1, 2}, resume_order="any")
    with pytest.raises(ValueError, match="resume_order"):
        check_queue_order([1], ARRIVAL, {}, set(), resume_order="newest")


# Six one-token pages, no prefix reuse (naive), ratio 0 (admission reserves the prefill only). The
# prefill admits all four; the first decode needs four pages with none free: uids 3 and 2 (newest
# first) are preempted and wait as [2, 3]. The next prefill resumes uid 2 (latest admission #4) and
# turns uid 3 away; the decode after preempts uid 2 again, which goes back ahead of uid 3, whose
# latest admission (#3) is older. Uid 1 ends at the first decode (max_tokens 2).
RESUMED_AND_PREEMPTED_AGAIN = [
    {"op": "submit", "uid": 0, "tokens": [1, 1], "max_tokens": 4},
    {"op": "submit", "uid": 1, "tokens": [2], "max_tokens": 2},
    {"op": "submit", "uid": 2, "tokens": [3], "max_tokens": 4},
    {"op": "submit", "uid": 3, "tokens": [4, 4], "max_tokens": 2},
    {"op": "prefill", "budget": 64, "sample": [0]},
    {"op": "decode", "sample": [0]},
    {"op": "prefill", "budget": 64, "sample": [0]},
    {"op": "decode", "sample": [0]},
]
HEADER = Header(
    num_pages=6,
    page_size=1,
    cache_type="naive",
    table_slots=4,
    max_seq_len=16,
    admission="optimistic",
    reserve_ratio=0.0,
    producer="test",
)


@pytest.mark.parametrize("impl", [reference, fast], ids=["reference", "fast"])
def test_the_cache_scheduler_resumes_by_first_admission_not_latest(impl):
    s = CacheScheduler(impl, **HEADER.cache_scheduler_args())
    results = [s.apply(op) for op in RESUMED_AND_PREEMPTED_AGAIN]  # each checks the queue's order
    assert [r.preempted for r in results[5:]] == [(3, 2), (), (2,)]
    assert results[6].refused == 3
    assert [p.uid for p in s.waiting] == [2, 3]
    assert (s._admitted_at[2], s._admitted_at[3]) == (4, 3)  # the newer latest admission waits first


def test_the_planted_bug_requeues_the_newer_victim_first_and_is_caught_there():
    assert BUGS[BUG].target is CacheScheduler  # both sides of lockstep run it: only the invariant sees it
    ops = RESUMED_AND_PREEMPTED_AGAIN
    with patched(BUG):
        lock = Lockstep(HEADER)
        for op in ops[:5]:
            lock.apply(op)
        with pytest.raises(Finding) as e:
            lock.apply(ops[5])  # uids 3 and 2 preempted: the bug queues them as [3, 2]
    assert e.value.kind == KIND
    assert "uid 3 (arrival #3, latest admission #3) waits again at place 0" in str(e.value)
    replay(HEADER, ops)  # the real code agrees with the model and keeps every invariant


def test_the_zoo_trace_of_the_planted_bug_is_short_and_caught_as_queue_order():
    header, ops = read(ZOO_TRACES / f"{BUG}.jsonl")
    assert len(ops) <= 10
    with patched(BUG), pytest.raises(Finding) as e:
        replay(header, ops)
    assert e.value.kind == KIND


def test_a_seeded_fuzz_run_catches_the_planted_bug_as_queue_order(tmp_path):
    # counted: the seed's first cases under optimistic admission and a minimization of at most 100
    # replays; the seconds are only a safety net, which would skip
    result = fuzz(
        600,
        workers=1,
        seed=1,
        out_dir=tmp_path,
        bug=BUG,
        progress=False,
        max_cases=CASES,
        minimize_budget=math.inf,
        minimize_replays=100,
        admission="optimistic",
    )
    if result.failure is None and result.cases < CASES:
        pytest.skip(f"the machine ran {result.cases} of {CASES} cases in 600 s")
    assert result.failure is not None and result.failure.kind == KIND
    assert result.failure.minimized_path is not None
    header, ops = read(result.failure.minimized_path)
    with patched(BUG), pytest.raises(Finding) as e:
        replay(header, ops)
    assert e.value.kind == KIND
