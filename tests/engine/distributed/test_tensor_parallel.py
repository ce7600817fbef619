"""Tensor parallelism on the CPU: the partition, sharded loading, and 2 gloo ranks against 1.

The multi-process tests spawn a second rank (a fresh interpreter, a few seconds each); tokens are
compared exactly (float32, greedy or seeded sampling), every run with --verify, so the shadow
reference and the cross-rank agreement check run after every cache operation."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from kvledger.engine.distributed.partition import FusedRows, PartitionError, TensorParallelShard
from kvledger.engine.distributed.rank_agreement import RankDisagreement
from kvledger.engine.distributed.ranks import RankFailed
from kvledger.engine.engine_config import EngineConfig
from kvledger.engine.model.config import builtin_config
from kvledger.engine.model.weights import load_weights, random_state_dict
from kvledger.engine.options import EngineOptionError
from kvledger.engine.runtime.llm import LLM
from kvledger.fast import SamplingParams
from tests.support.models import tiny_config

TINY = tiny_config(
    vocab_size=307, intermediate_size=99, num_heads=6, num_kv_heads=3, tie_word_embeddings=False, eos_token_ids=(5,)
)
SHAPES = (
    [(TINY, n) for n in (1, 2, 3, 6)]
    + [(builtin_config("qwen3-0.6b"), n) for n in (2, 4, 8, 16)]
    + [(builtin_config("smollm2-135m"), n) for n in (2, 3, 9)]
)


# -- the partition ----------------------------------------------------------------------------------
@pytest.mark.parametrize("config,size", SHAPES, ids=lambda x: str(x) if isinstance(x, int) else x.arch)
def test_every_query_head_has_one_rank_and_reads_only_kv_heads_that_rank_holds(config, size):
    group = config.num_heads // config.num_kv_heads
    shards = [TensorParallelShard(r, size) for r in range(size)]
    TensorParallelShard(0, size).check(config)
    heads = [h for s in shards for h in s.heads(config)]
    assert sorted(heads) == list(range(config.num_heads))
    for s in shards:
        q, kv = s.heads(config), s.kv_heads(config)
        assert len(q) >= 1 and len(q) % len(kv) == 0
        local_group = len(q) // len(kv)
        # the kernels map local query head i to local KV head i // local_group: it must be its own
        assert [kv.start + i // local_group for i in range(len(q))] == [h // group for h in q]
    for dim in ("intermediate", "vocab"):
        parts = [getattr(s, dim)(config) for s in shards]
        assert [i for p in parts for i in p] == list(range(getattr(config, f"{dim}_size")))


@pytest.mark.parametrize(
    "config,size,what",
    [
        (builtin_config("smollm2-135m"), 4, "3 KV heads"),
        (builtin_config("qwen3-0.6b"), 32, "only 16 attention heads"),
        (TINY, 0, "must be >= 1"),
    ],
)
def test_a_size_the_heads_do_not_split_over_is_refused_naming_why(config, size, what):
    with pytest.raises(PartitionError, match=what):
        TensorParallelShard(0, size).check(config)


def test_the_option_is_checked_against_the_model_before_any_rank_starts():
    with pytest.raises(EngineOptionError, match="tensor_parallel_size 4 does not fit the model"):
        LLM("smollm2-135m", dummy_weights=True, tensor_parallel_size=4)
    with pytest.raises(EngineOptionError, match="tensor_parallel_size must be an integer"):
        EngineConfig(tensor_parallel_size="2")
    with pytest.raises(EngineOptionError, match="tensor_parallel_size must be at least 1"):
        EngineConfig(tensor_parallel_size=0)


def test_the_command_line_takes_tp_and_tensor_parallel_size():
    import argparse

    for flags in (["--tp", "2"], ["--tensor-parallel-size", "2"]):
        p = argparse.ArgumentParser()
        EngineConfig.add_arguments(p)
        assert EngineConfig.from_args(p.parse_args(flags)).tensor_parallel_size == 2


@pytest.mark.parametrize("size", [2, 3])
def test_random_weights_cut_per_rank_are_the_whole_model_cut(size):
    whole = random_state_dict(TINY, seed=3)
    for r in range(size):
        shard = TensorParallelShard(r, size)
        part = random_state_dict(TINY, seed=3, shard=shard)
        assert part.keys() == whole.keys()
        for name, t in part.items():
            assert torch.equal(t, shard.take(name, TINY, lambda: whole[name])), name


def test_qkv_and_gate_up_shards_hold_exactly_their_heads_and_features():
    whole = random_state_dict(TINY, seed=1)
    d, q_rows, kv_rows = TINY.head_dim, TINY.num_heads * TINY.head_dim, TINY.num_kv_heads * TINY.head_dim
    qkv = whole["layers.0.attn.qkv_proj.weight"]
    q, k, v = qkv[:q_rows], qkv[q_rows : q_rows + kv_rows], qkv[q_rows + kv_rows :]
    for r in range(2):
        s = TensorParallelShard(r, 2)
        hq, hk = s.heads(TINY), s.kv_heads(TINY)
        part = s.take("layers.0.attn.qkv_proj.weight", TINY, lambda: qkv)
        want = torch.cat([q[hq.start * d : hq.stop * d], k[hk.start * d : hk.stop * d], v[hk.start * d : hk.stop * d]])
        assert torch.equal(part, want)
        # the separate pieces of a Hugging Face checkpoint read the same rows
        fused = FusedRows([(q, q_rows), (k, kv_rows), (v, kv_rows)])
        assert torch.equal(s.take("layers.0.attn.qkv_proj.weight", TINY, lambda: fused), want)
        o = s.take("layers.0.attn.o_proj.weight", TINY, lambda: whole["layers.0.attn.o_proj.weight"])
        assert torch.equal(o, whole["layers.0.attn.o_proj.weight"][:, hq.start * d : hq.stop * d])


def _hf_dir(tmp_path):
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=301,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=False,
    )
    Qwen3ForCausalLM(cfg).eval().save_pretrained(tmp_path)
    return tmp_path


def test_a_hugging_face_directory_loads_per_rank_as_the_whole_state_cut(tmp_path):
    path = _hf_dir(tmp_path)
    config, whole = load_weights(path)
    for r in range(2):
        shard = TensorParallelShard(r, 2)
        _, part = load_weights(path, shard=shard)
        assert part.keys() == whole.keys()
        for name, t in part.items():
            assert torch.equal(t, shard.take(name, config, lambda: whole[name])), name


def test_the_embedded_model_loads_per_rank_from_its_cache_as_the_whole_state_cut():
    config, whole = load_weights(None)
    shard = TensorParallelShard(1, 2)
    _, part = load_weights(None, shard=shard)
    for name in ("embed_tokens.weight", "layers.3.attn.qkv_proj.weight", "layers.3.mlp.down_proj.weight"):
        assert torch.equal(part[name], shard.take(name, config, lambda: whole[name]))
    assert part["embed_tokens.weight"].shape[0] == config.vocab_size // 2


# -- two gloo ranks against one ---------------------------------------------------------------------
def _run(model, size, prompts, params, **options):
    with LLM(model, tensor_parallel_size=size, threads=1, verify=True, **options) as llm:
        outs = llm.generate(prompts, params)
        steps = llm.engine.operations
        ledger = llm.engine.coordination.agreement.operations if size > 1 else None
    return [o.token_ids for o in outs], steps, ledger


SHARED = list(range(20, 52))
PROMPTS = [SHARED + [1, 2, 3], SHARED + [9, 8], list(range(100, 140)), SHARED[:20] + [7], [3, 1, 4, 1, 5, 9]]


@pytest.mark.parametrize(
    "options",
    [
        dict(page_size=4, max_prefill_tokens=24),  # chunked prefill, prefix hits on a radix cache
        dict(page_size=2, cache_type="naive", kv_cache_tokens=96, admission="optimistic", reserve_ratio=0.1),
    ],
    ids=["radix-chunked", "optimistic-preempting"],
)
def test_two_ranks_generate_the_tokens_of_one(options):
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_k=20, max_tokens=10, seed=7)
    params = [greedy, sampled, greedy, sampled, greedy]
    one, steps1, _ = _run(TINY, 1, PROMPTS, params, dummy_weights=True, **options)
    two, steps2, ledger = _run(TINY, 2, PROMPTS, params, dummy_weights=True, **options)
    assert two == one
    assert steps2 == steps1  # the same cache operations, one by one
    assert ledger == steps2  # every one compared across the ranks


def test_two_ranks_generate_the_embedded_models_tokens():
    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    one, _, _ = _run(None, 1, prompts, params, max_seq_len=256)
    two, _, _ = _run(None, 2, prompts, params, max_seq_len=256)
    assert two == one and all(len(t) > 0 for t in one)


def fail_on_rank_1(rank, step, engine):
    if rank == 1 and step == 3:
        raise RuntimeError("planted failure on rank 1")


def fail_on_rank_0(rank, step, engine):
    if rank == 0 and step == 3:
        raise ValueError("planted failure on rank 0")


def reorder_free_pages_on_rank_1(rank, step, engine):
    if rank == 1 and step == 2:  # the next allocation hands out other pages than rank 0's
        cm = engine.cache_scheduler.cm
        cm.free_slots = cm.free_slots.flip(0)


def _children():
    return [p for p in multiprocessing.active_children() if p.name.startswith("kvledger-rank")]


def test_a_second_engine_while_one_runs_is_refused_and_the_first_keeps_working():
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with LLM(TINY, dummy_weights=True, tensor_parallel_size=2, threads=1) as first:
        with pytest.raises(RuntimeError, match="close\\(\\) that LLM first"):
            LLM(TINY, dummy_weights=True, tensor_parallel_size=2, threads=1)
        assert [len(o.token_ids) for o in first.generate(PROMPTS[:2], params)] == [3, 3]
    assert _children() == []


@pytest.mark.parametrize(
    "hook,error,match",
    [
        (fail_on_rank_1, RankFailed, "rank 1 failed: RuntimeError: planted failure on rank 1"),
        (fail_on_rank_0, ValueError, "planted failure on rank 0"),
        (reorder_free_pages_on_rank_1, RankDisagreement, r"ranks \[1\] disagree with rank 0 after cache operation \d+"),
    ],
)
def test_a_rank_that_fails_or_diverges_ends_the_run_with_its_error(hook, error, match):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(TINY, dummy_weights=True, tensor_parallel_size=2, threads=1, verify=True, page_size=2, rank_hook=hook)
    try:
        with pytest.raises(error, match=match):
            llm.generate(PROMPTS, params)
        with pytest.raises(RuntimeError, match="tensor-parallel engine has stopped"):
            llm.generate(PROMPTS[:1], params)
    finally:
        llm.close()
    assert _children() == []  # no rank left behind


# -- the command line, torchrun and the server ---------------------------------------------------------
GENERATE = ["generate", "The capital of France is", "--max-tokens", "8", "--threads", "1", "--max-seq-len", "256"]


def test_torchrun_runs_kvledger_generate_on_two_ranks_with_the_tokens_of_one(capsys):
    import subprocess
    import sys

    from kvledger.cli import main

    assert main(GENERATE) == 0
    alone = capsys.readouterr().out
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "kvledger",
            *GENERATE,
            "--tp",
            "2",
            "--verify",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == alone and alone.strip()  # rank 0 alone prints; rank 1 served it and left


def test_the_server_answers_from_two_ranks_as_from_one():
    from fastapi.testclient import TestClient

    from kvledger.engine.server.app import create_app
    from kvledger.engine.server.worker import EngineWorker

    texts = {}
    for size in (1, 2):
        with LLM(max_seq_len=256, kv_cache_tokens=1024, threads=1, tensor_parallel_size=size) as llm:
            with TestClient(create_app(EngineWorker(llm), model_name="m")) as client:
                r = client.post(
                    "/v1/completions",
                    json={"model": "m", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
                )
                assert r.status_code == 200, r.text
                texts[size] = r.json()["choices"][0]["text"]
                bad = client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": -1})
                assert bad.status_code == 400  # refused on rank 0 before any rank hears of it
    assert texts[2] == texts[1] and texts[1]
