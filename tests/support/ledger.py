"""Cache schedulers (engine/ledger/cache_scheduler.py) built and driven the way the hand-worked
tests of tests/reference, tests/fast and tests/engine/ledger need them."""

from __future__ import annotations

from kvledger import fast
from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.reference.admission_policy import AdmissionPolicy

OPTIMISTIC = AdmissionPolicy("optimistic", 0.0)


def sched(impl=fast, *, num_pages=16, page_size=1, cache_type="radix", table_slots=4, max_seq_len=64, **kw):
    return CacheScheduler(
        impl,
        num_pages=num_pages,
        page_size=page_size,
        cache_type=cache_type,
        table_slots=table_slots,
        max_seq_len=max_seq_len,
        **kw,
    )


def drive(s, ops):
    """Apply trace lines in order: their results."""
    return [s.apply(op) for op in ops]


def live_scheduler(impl=fast):
    """A scheduler with a request live (10 prompt tokens, 2 whole pages cached by the radix cache
    and locked by it, its own third page) and 5 free pages of 4 tokens: (scheduler, its cache
    manager, the live requests)."""
    s = sched(impl, num_pages=8, page_size=4, max_seq_len=32)
    s.submit(0, list(range(1, 11)), 8)
    s.prefill(64, [50])
    return s, s.cm, list(s.live.values())


# uid 1 computes 5 positions, is preempted, and re-prefills hitting 3 of them (reference, 8 one-token
# pages, radix, optimistic admission with ratio 0, max_seq_len 16)
PREEMPT_THEN_HIT = [
    {"op": "submit", "uid": 0, "tokens": [2, 2, 9], "max_tokens": 5},
    {"op": "submit", "uid": 1, "tokens": [2, 2, 2], "max_tokens": 5},
    {"op": "prefill", "budget": 64, "sample": [10, 20]},
    {"op": "decode", "sample": [11, 21]},
    {"op": "decode", "sample": [12, 22]},
    {"op": "decode", "sample": [13, 23]},  # preempts uid 1, which had computed [2, 2, 2, 20, 21]
    {"op": "decode", "sample": [14]},  # uid 0 ends
    {"op": "prefill", "budget": 64, "sample": [24]},
]
