"""Tensor parallelism over NCCL on two GPUs: TP=2 against TP=1 with CUDA graphs and overlap on.

`cuda(devices=2)`-marked: skipped without two CUDA devices (CI has none). float32, so that the
ranks' different summation order (partial sums all-reduced) cannot flip a greedy token."""

from __future__ import annotations

import pytest

from kvledger.fast import SamplingParams
from tests.support.models import tiny_qwen3

pytestmark = pytest.mark.cuda(devices=2)

TINY = tiny_qwen3()


def _workload(n=40, seed=0):
    import random

    rng = random.Random(seed)
    shared = [rng.randrange(1024) for _ in range(64)]
    prompts = [
        (shared if i % 3 == 0 else []) + [rng.randrange(1024) for _ in range(rng.randint(1, 150))] for i in range(n)
    ]
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(1, 50))
        if i % 5
        else SamplingParams(temperature=0.7, top_p=0.9, max_tokens=rng.randint(1, 50), seed=i)
        for i in range(n)
    ]
    return prompts, params


@pytest.mark.parametrize("verify", [False, True])
def test_two_gpus_generate_the_tokens_of_one_with_graphs_and_overlap(verify):
    from kvledger.engine.runtime.llm import LLM

    prompts, params = _workload()
    kw = dict(
        dummy_weights=True,
        device="cuda",
        dtype="float32",
        page_size=16,
        kv_cache_tokens=20000,
        max_running_req=40,
        max_seq_len=512,
        max_prefill_tokens=512,
        cuda_graphs=True,
        overlap=True,
        verify=verify,
    )
    with LLM(TINY, **kw) as one:
        expected = [o.token_ids for o in one.generate(prompts, params)]
    with LLM(TINY, tensor_parallel_size=2, **kw) as two:
        assert two.engine.graphs is not None and two.engine.graphs.graphs and two.engine.overlap.enabled
        got = [o.token_ids for o in two.generate(prompts, params)]
        if verify:
            assert two.engine.coordination.agreement.operations == two.engine.operations
    assert got == expected


def fail_on_rank_1(rank, step, engine):
    if rank == 1 and step == 4:
        raise RuntimeError("planted failure on rank 1")


def test_a_failing_gpu_rank_ends_the_run_with_its_error():
    from kvledger.engine.distributed.ranks import RankFailed
    from kvledger.engine.runtime.llm import LLM

    prompts, params = _workload(n=8)
    llm = LLM(
        TINY,
        dummy_weights=True,
        device="cuda",
        dtype="bfloat16",
        tensor_parallel_size=2,
        kv_cache_tokens=8000,
        max_seq_len=512,
        rank_hook=fail_on_rank_1,
    )
    try:
        with pytest.raises(RankFailed, match="rank 1 failed: RuntimeError: planted failure on rank 1"):
            llm.generate(prompts, params)
    finally:
        llm.close()
    assert all(not p.is_alive() for p in llm_ranks_procs(llm))


def llm_ranks_procs(llm):
    import multiprocessing

    return [p for p in multiprocessing.active_children() if p.name.startswith("kvledger-rank")]
