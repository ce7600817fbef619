"""The rare-branch notes the model passes through (kvledger.reference.events: the evidence `kvledger
check` reports), operation by operation on scripted runs."""

# Mutation killers (`kvledger mutation`, properties/mutation.toml; results/mutation/README.md lists
# what survives): the lockstep run cannot see a mutant of code both sides share, of a check a correct
# run never trips, or of arithmetic that differs only on inputs the generators never draw (page sizes
# that are not powers of two, token ids above 256, uids that are not small ints). Each test here pins
# one of those down with numbers worked out by hand.

from __future__ import annotations

from kvledger import reference
from tests.support.ledger import OPTIMISTIC, PREEMPT_THEN_HIT, sched


def _notes_per_step(s, steps, noted):
    out = []
    for step in steps:
        before = len(noted)
        step(s)
        out.append(noted[before:])
    return out


def test_the_model_notes_each_branch_it_takes_on_a_scripted_preemption(noted):
    s = sched(reference, num_pages=8, max_seq_len=16, admission=OPTIMISTIC)
    per_op = _notes_per_step(s, [lambda s, op=op: s.apply(op) for op in PREEMPT_THEN_HIT], noted)
    lock_leaf, inserted = "radix: lock/unlock of an evictable leaf", "cache_req: new prefix inserted"
    assert per_op == [
        [],
        [],
        [
            inserted,
            lock_leaf,
            "radix: node split",
            "cache_req: duplicate prefix freed while running",
            inserted,
            lock_leaf,
        ],  # uid 0 caches [2, 2, 9]; uid 1 splits it at [2, 2] and frees its own copy of that
        [],
        [],
        [
            "preempt: running request",
            "preempt: a request of the step's own batch",
            inserted,
            "allocate: evicts from the prefix cache",
            "radix: eviction makes the parent an evictable leaf",
        ],
        [inserted],  # uid 0 ends
        [
            lock_leaf,
            "admission: prefix hit",
            "preempt: re-prefill hits the prefix cache",
            "allocate: evicts from the prefix cache",
            "radix: eviction makes the parent an evictable leaf",
            inserted,
            lock_leaf,
        ],
    ]


def test_the_model_notes_partial_pages_rejections_and_a_second_preemption(noted):
    s = sched(reference, num_pages=6, cache_type="naive", max_seq_len=32, admission=OPTIMISTIC)
    s.submit(0, [1, 1], 2)
    s.submit(1, [2, 2], 5)
    s.submit(2, [3], 4)

    def step(s):
        result = s.prefill(64, [5]) if s.waiting else None
        if not result or not (result.batch or result.preempted):
            s.decode([5])

    per_op = _notes_per_step(s, [step] * 8, noted)
    preempted, tail = (
        ["preempt: running request", "preempt: a request of the step's own batch"],
        "cache_req: partial tail page freed",
    )
    assert per_op == [
        [],
        preempted + [tail, tail],
        [],
        preempted + [tail, "preempt: the same request preempted twice"],
        ["admission: rejected"],
        ["admission: rejected", tail],
        [],
        [tail],
    ]
    assert not s.live and not s.waiting
