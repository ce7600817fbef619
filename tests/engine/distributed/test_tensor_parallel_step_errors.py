"""A forward pass that raises, under tensor parallelism (two gloo ranks on the CPU): an injected
forward-raise strikes every rank alike, so each contains it by itself and the ranks still agree
(--verify compares their operations); a real error on one rank is not contained, since its peer
would wait in a collective that never meets: rank 0 raises RankFailed naming it, and no rank is
left behind. Decided by outputs and counts; the timeout only guards against a hang."""

from __future__ import annotations

import multiprocessing

import pytest

from kvledger.engine.distributed.rank_errors import RankFailed
from kvledger.engine.runtime.llm import LLM
from kvledger.fast import SamplingParams
from tests.support.models import tiny_config

TINY = tiny_config(
    vocab_size=307, intermediate_size=99, num_heads=6, num_kv_heads=3, tie_word_embeddings=False, eos_token_ids=(5,)
)
PROMPTS = [list(range(20, 52)) + [1, 2, 3], list(range(100, 140)), [3, 1, 4, 1, 5, 9], list(range(60, 75))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
OPTIONS = dict(dummy_weights=True, tensor_parallel_size=2, threads=1, page_size=2, max_prefill_tokens=40, verify=True)
pytestmark = pytest.mark.timeout(300)


def _rank_children():
    return [p for p in multiprocessing.active_children() if p.name.startswith("kvledger-rank")]


def raise_on_rank_1_at_step_3(rank, step, engine):
    if rank == 1 and step == 3:

        def forward(*args, **kwargs):
            raise RuntimeError("a shape only rank 1 saw")

        engine.runner.forward = forward


def generate(**extra):
    llm = LLM(TINY, **OPTIONS, **extra)
    try:
        return llm, llm.generate(PROMPTS, PARAMS)
    finally:
        llm.close()


def test_an_injected_forward_raise_is_contained_on_every_rank_alike():
    _, reference = generate()
    llm, outs = generate(inject_fault="forward-raise@step=2")
    ended = [i for i, o in enumerate(outs) if o.finish_reason == "error"]
    assert ended and len(ended) < len(PROMPTS)
    assert all("injected forward-raise" in str(outs[i].error) for i in ended)
    assert all(o.token_ids == reference[i].token_ids for i, o in enumerate(outs) if i not in ended)
    assert llm.shadow is not None and llm.shadow.steps == llm.engine.operations  # and rank 1's agreed
    assert _rank_children() == []


def test_a_real_error_on_one_rank_is_not_contained():
    llm = LLM(TINY, **OPTIONS, rank_hook=raise_on_rank_1_at_step_3)
    try:
        with pytest.raises(RankFailed, match="rank 1 failed: RuntimeError: a shape only rank 1 saw"):
            llm.generate(PROMPTS, PARAMS)
    finally:
        llm.close()
    assert _rank_children() == []
