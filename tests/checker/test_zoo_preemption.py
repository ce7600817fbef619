"""The zoo's preemption bugs (optimistic admission): their traces run under the optimistic policy,
the Preemptor bugs' traces really preempt on the real code, and a bug of a module function
(`fast.admission._reserved_pages`) is seen by its callers inside `patched` and gone after it."""

import pytest

from kvledger import fast
from kvledger.engine.ledger import trace
from kvledger.properties.lockstep import Lockstep
from kvledger.subjects.fast_zoo import BUGS, patched
from tests.support.paths import ZOO_TRACES

TRACES = ZOO_TRACES
PREEMPTION = sorted(
    n for n, b in BUGS.items() if b.target in (fast.Preemptor, fast.admission) or b.method == "needed_size"
)


def test_the_preemption_bugs_are_in_the_zoo():
    assert len(PREEMPTION) >= 5


@pytest.mark.parametrize("name", PREEMPTION)
def test_trace_is_optimistic(name):
    header, _ = trace.read(TRACES / f"{name}.jsonl")
    assert header.admission == "optimistic" and header.kvledger_trace == 2


@pytest.mark.parametrize("name", sorted(n for n in PREEMPTION if BUGS[n].target is fast.Preemptor))
def test_preemptor_trace_preempts_on_the_real_code(name):
    header, ops = trace.read(TRACES / f"{name}.jsonl")
    lock = Lockstep(header)
    preempted = [uid for op in ops for uid in lock.apply(op).preempted or ()]
    assert preempted, f"{name}: its trace never preempts"


def test_a_module_function_bug_is_seen_by_callers_and_removed_after():
    live = fast.admission.__dict__["_reserved_pages"]
    policy = fast.AdmissionPolicy("optimistic", 0.0)
    # a request of device_len 2 that may still grow: ratio 0 still reserves its next token
    assert fast.admission._reserved_pages(policy, 1, 2, 5, 1) == 1
    with patched("optimistic-no-next-token"):
        assert fast.admission.__dict__["_reserved_pages"] is not live
        assert fast.admission._reserved_pages(policy, 1, 2, 5, 1) == 0
    assert fast.admission.__dict__["_reserved_pages"] is live
