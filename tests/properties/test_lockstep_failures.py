"""A bug both implementations share is caught by an invariant the *reference* checks while it
applies an operation. The trace kept must end with that operation, so it replays as a failure
and minimizes (it used to stop just before it: replay printed OK, minimize found nothing)."""

import math

import pytest

from kvledger import fast, reference
from kvledger.checker.audit.invariant_catches import shared
from kvledger.checker.minimize import minimize
from kvledger.engine.ledger import trace
from kvledger.engine.ledger.finding import Finding
from kvledger.properties.lockstep import Lockstep, replay
from kvledger.subjects.fast_zoo import Bug
from tests.support.paths import REGRESSIONS

# the same edit on both sides: a request turned away after locking its prefix hit keeps the lock
KEEPS_LOCK = ("cm.unlock(handle)", "pass  # BUG: the lock taken for the hit is kept")


SHARED_BUG = tuple(
    Bug("rejection-keeps-lock", "test", "both sides", impl.PrefillAdder, "_try_allocate_one", (KEEPS_LOCK,))
    for impl in (reference, fast)
)


def _run_until_divergence(header, ops):
    lock = Lockstep(header)
    for op in ops:
        try:
            lock.apply(op)
        except Finding as e:
            return lock, e
    return lock, None


def test_a_failure_the_reference_raises_keeps_its_operation_in_the_trace(tmp_path):
    header, ops = trace.read(REGRESSIONS / "admission_rechecks_after_locking.jsonl")
    assert _run_until_divergence(header, ops)[1] is None  # the unpatched trace passes
    with shared(SHARED_BUG):
        lock, err = _run_until_divergence(header, ops)
        assert err is not None and err.kind == "reference-invariant:4-failed-admission"
        assert lock.ops[-1] == ops[err.step - 1] and lock.ops[-1].to_json() == err.op and len(lock.ops) == err.step
        saved = tmp_path / "failure.jsonl"
        trace.write(saved, header, lock.ops)
        with pytest.raises(Finding) as replayed:
            replay(*trace.read(saved))
        assert replayed.value.kind == err.kind and replayed.value.step == len(lock.ops)
        m_header, m_ops, fingerprint = minimize(header, lock.ops, budget=math.inf, max_replays=300)
    assert fingerprint == err.kind and len(m_ops) <= len(lock.ops)
    assert m_ops[-1].to_json()["op"] == "prefill"


def test_an_invalid_operation_is_not_kept():
    header = trace.Header(num_pages=4, page_size=1, cache_type="radix", table_slots=2, max_seq_len=8)
    lock = Lockstep(header)
    lock.apply({"op": "submit", "uid": 0, "tokens": [1], "max_tokens": 1})
    with pytest.raises(Exception, match="not running"):
        lock.apply({"op": "finish", "uid": 7})
    assert [op.name for op in lock.ops] == ["submit"]
