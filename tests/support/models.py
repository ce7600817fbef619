"""Tiny random models and workloads that several engine tests share."""

from __future__ import annotations

import random

TINY_DEFAULTS = dict(
    arch="qwen3",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_ids=(),
)


def tiny_config(**fields):
    """A tiny Qwen3 shape for random weights; a test names the fields its case depends on."""
    from kvledger.engine.model.config import ModelConfig

    return ModelConfig(**{**TINY_DEFAULTS, **fields})


def tiny_qwen3():
    """A 3-layer Qwen3 of vocabulary 1024 (GQA 8:2, head_dim 32, EOS 5): dummy weights, a few MB."""
    from kvledger.engine.model.config import ModelConfig

    return ModelConfig(
        arch="qwen3",
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_layers=3,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        bos_token_id=None,
        eos_token_ids=(5,),
    )


def nano_like(n=40, seed=0):
    """nano-vllm's benchmark shape, small: n prompts of 1-200 tokens, greedy, 1-60 output tokens."""
    from kvledger.fast import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(1, 200))] for _ in range(n)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(1, 60)) for _ in range(n)]
    return prompts, params
