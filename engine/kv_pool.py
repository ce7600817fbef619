"""Paged KV storage with page size 1: every token location owns one K and one V row per layer."""

from __future__ import annotations

import torch

from kvledger.engine.config import ModelConfig


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_tokens = num_tokens
        # One more row than the cache manager hands out: padded rows of a CUDA-graph batch write
        # their K/V there, never into a page some request owns.
        self.scratch_loc = num_tokens
        # Head-major: k[layer] is a [kv_heads, num_tokens, head_dim] view, so gathering a request's
        # rows yields [kv_heads, len, head_dim] blocks that attention matmuls read without a transpose.
        # One allocation each for K and V.
        shape = (num_layers, num_kv_heads, num_tokens + 1, head_dim)
        self.k_buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.v_buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.k = list(self.k_buffer.unbind(0))
        self.v = list(self.v_buffer.unbind(0))

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        num_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_heads: int | None = None,
    ) -> KVPool:
        """`kv_heads`: the KV heads this pool holds (a tensor-parallel rank's share); default all."""
        return cls(config.num_layers, num_tokens, kv_heads or config.num_kv_heads, config.head_dim, dtype, device)

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype, kv_heads: int | None = None) -> int:
        return 2 * config.num_layers * (kv_heads or config.num_kv_heads) * config.head_dim * dtype.itemsize

    @classmethod
    def tokens_that_fit(cls, config: ModelConfig, dtype: torch.dtype, free_bytes: int, fraction: float = 0.9,
                        reserve_bytes: int = 0, kv_heads: int | None = None) -> int:
        """How many KV tokens a pool may hold given free device memory: `fraction` of what is free
        after `reserve_bytes` (activations, logits, CUDA graphs) are set aside."""
        per_token = cls.bytes_per_token(config, dtype, kv_heads)
        return max(0, int((free_bytes - reserve_bytes) * fraction) // per_token)

    token_dim = 1  # of each layer's [kv_heads, tokens, head_dim] view

    @property
    def dtype(self) -> torch.dtype:
        return self.k_buffer.dtype

    @property
    def device(self) -> torch.device:
        return self.k_buffer.device

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v ([T, kv_heads, head_dim]) at token locations loc ([T])."""
        self.k[layer].index_copy_(1, loc, k.transpose(0, 1).to(self.dtype))
        self.v[layer].index_copy_(1, loc, v.transpose(0, 1).to(self.dtype))

    def gather(self, layer: int, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the tokens at loc ([S]), each [kv_heads, S, head_dim]."""
        return self.k[layer].index_select(1, loc), self.v[layer].index_select(1, loc)
