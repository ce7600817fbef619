"""The same code on CUDA: the lockstep harness with fast on the GPU. Skips without CUDA."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_fast_on_cuda_matches_reference_through_a_mixed_workload():
    from properties.lockstep import Lockstep
    from properties.trace import Header

    for page_size, cache in [(1, "radix"), (4, "radix"), (16, "naive")]:
        lock = Lockstep(Header(num_pages=24, page_size=page_size, cache_type=cache, table_slots=6, max_seq_len=256),
                        device="cuda")
        for uid in range(12):
            lock.apply({"op": "submit", "uid": uid, "tokens": [uid % 3] * (5 + 3 * uid), "max_tokens": 1 + uid % 5})
        while lock.ref.waiting or lock.ref.dm.runnable:
            if lock.ref.waiting and lock.apply({"op": "prefill", "budget": 16, "sample": [1, 2]})["batch"]:
                continue
            lock.apply({"op": "decode", "sample": [3]})
        assert lock.fast.cm.free_slots.is_cuda and lock.fast.page_table.is_cuda
        lock.fast.cm.check_integrity()


def test_hypothesis_lockstep_on_cuda(monkeypatch):
    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test

    from properties import lockstep, machine

    real_init = lockstep.Lockstep.__init__
    monkeypatch.setattr(lockstep.Lockstep, "__init__", lambda self, header, device="cpu", **kw: real_init(self, header, "cuda", **kw))
    run_state_machine_as_test(machine.LockstepMachine, settings=settings(max_examples=100, stateful_step_count=40, deadline=None))
