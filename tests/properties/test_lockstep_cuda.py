"""The lockstep harness with fast on the GPU: a scripted mixed workload and the Hypothesis machine,
reference on the host and fast's tensors on CUDA. `cuda`-marked: skipped without a CUDA device."""

import pytest

pytestmark = pytest.mark.cuda


def test_fast_on_cuda_matches_reference_through_a_mixed_workload():
    from kvledger.engine.ledger.trace import Header
    from kvledger.properties.lockstep import Lockstep

    for page_size, cache in [(1, "radix"), (4, "radix"), (16, "naive")]:
        lock = Lockstep(
            Header(num_pages=48, page_size=page_size, cache_type=cache, table_slots=6, max_seq_len=256), device="cuda"
        )
        for uid in range(12):
            lock.apply({"op": "submit", "uid": uid, "tokens": [uid % 3] * (5 + 3 * uid), "max_tokens": 1 + uid % 5})
        for _ in range(500):
            if not (lock.ref.waiting or lock.ref.dm.runnable):
                break
            if lock.ref.waiting and lock.apply({"op": "prefill", "budget": 16, "sample": [1, 2]}).batch:
                continue
            lock.apply({"op": "decode", "sample": [3]})
        assert not lock.ref.live
        assert lock.fast.cm.free_slots.is_cuda and lock.fast.page_table.is_cuda
        lock.fast.cm.check_integrity()


def test_hypothesis_lockstep_on_cuda(monkeypatch):
    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test

    from kvledger.properties import lockstep, machine

    real_init = lockstep.Lockstep.__init__
    monkeypatch.setattr(
        lockstep.Lockstep, "__init__", lambda self, header, device="cpu", **kw: real_init(self, header, "cuda", **kw)
    )
    run_state_machine_as_test(
        machine.LockstepMachine, settings=settings(max_examples=15, stateful_step_count=25, deadline=None)
    )
