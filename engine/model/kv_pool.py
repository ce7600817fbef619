"""Paged KV storage with page size 1: every token location owns one K and one V row per layer.

With an FP8 cache (`kv_dtype=torch.float8_e4m3fn`) each row is stored as x / scale in e4m3 and
read back as fp8 * scale, with one scale for K and one for V per layer (vLLM's and SGLang's
per-tensor scales, calibrated by `kvledger.engine.model.kv_scales`). The pool then holds half
the bytes of bf16 per token; attention reads fp8 and applies the scales itself.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from kvledger.engine.model.config import ModelConfig

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value; a cast past it would be NaN, so stores clamp
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": FP8}


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_dtype: Optional[torch.dtype] = None,
        k_scales: Optional[Sequence[float]] = None,
        v_scales: Optional[Sequence[float]] = None,
    ) -> None:
        """dtype: the model's (what attention computes in, what `gather` returns); kv_dtype: what
        the pool stores (default: dtype)."""
        self.num_tokens = num_tokens
        self.compute_dtype = dtype
        # One more row than the cache manager hands out: padded rows of a CUDA-graph batch write
        # their K/V there, never into a page some request owns.
        self.scratch_loc = num_tokens
        # Head-major: k[layer] is a [kv_heads, num_tokens, head_dim] view, so gathering a request's
        # rows yields [kv_heads, len, head_dim] blocks that attention matmuls read without a transpose.
        # One allocation each for K and V.
        shape = (num_layers, num_kv_heads, num_tokens + 1, head_dim)
        self.k_buffer = torch.zeros(shape, dtype=kv_dtype or dtype, device=device)
        self.v_buffer = torch.zeros(shape, dtype=kv_dtype or dtype, device=device)
        self.k = list(self.k_buffer.unbind(0))
        self.v = list(self.v_buffer.unbind(0))
        self.k_scale: List[float] = list(k_scales) if k_scales is not None else [1.0] * num_layers
        self.v_scale: List[float] = list(v_scales) if v_scales is not None else [1.0] * num_layers

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        num_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_heads: int | None = None,
        kv_dtype: Optional[torch.dtype] = None,
    ) -> KVPool:
        """`kv_heads`: the KV heads this pool holds (a tensor-parallel rank's share); default all."""
        return cls(
            config.num_layers, num_tokens, kv_heads or config.num_kv_heads, config.head_dim, dtype, device, kv_dtype
        )

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype, kv_heads: int | None = None) -> int:
        """`dtype`: what the pool stores."""
        return 2 * config.num_layers * (kv_heads or config.num_kv_heads) * config.head_dim * dtype.itemsize

    @classmethod
    def tokens_that_fit(
        cls,
        config: ModelConfig,
        dtype: torch.dtype,
        free_bytes: int,
        fraction: float = 0.9,
        reserve_bytes: int = 0,
        kv_heads: int | None = None,
    ) -> int:
        """How many KV tokens a pool may hold given free device memory: `fraction` of what is free
        after `reserve_bytes` (activations, logits, CUDA graphs) are set aside."""
        per_token = cls.bytes_per_token(config, dtype, kv_heads)
        return max(0, int((free_bytes - reserve_bytes) * fraction) // per_token)

    token_dim = 1  # of each layer's [kv_heads, tokens, head_dim] view

    @property
    def dtype(self) -> torch.dtype:
        """What the pool stores (fp8 for an FP8 cache; see compute_dtype)."""
        return self.k_buffer.dtype

    @property
    def quantized(self) -> bool:
        return self.k_buffer.dtype == FP8

    @property
    def device(self) -> torch.device:
        return self.k_buffer.device

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v ([T, kv_heads, head_dim]) at token locations loc ([T])."""
        if not self.quantized:
            self.k[layer].index_copy_(1, loc, k.transpose(0, 1).to(self.dtype))
            self.v[layer].index_copy_(1, loc, v.transpose(0, 1).to(self.dtype))
            return
        # torch has no fp8 index_copy_ on the CPU: copy the bytes
        for pool, x, scale in ((self.k[layer], k, self.k_scale[layer]), (self.v[layer], v, self.v_scale[layer])):
            q = self.quantize(x.transpose(0, 1), scale)
            pool.view(torch.uint8).index_copy_(1, loc, q.view(torch.uint8))

    def gather(self, layer: int, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the tokens at loc ([S]), each [kv_heads, S, head_dim], in compute_dtype."""
        k, v = self.k[layer].index_select(1, loc), self.v[layer].index_select(1, loc)
        if not self.quantized:
            return k, v
        return self.dequantize(k, self.k_scale[layer]), self.dequantize(v, self.v_scale[layer])

    def round_trip(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v ([T, kv_heads, head_dim]) as the pool returns them once stored."""
        if not self.quantized:
            return k, v
        return (
            self.dequantize(self.quantize(k, self.k_scale[layer]), self.k_scale[layer]),
            self.dequantize(self.quantize(v, self.v_scale[layer]), self.v_scale[layer]),
        )

    @staticmethod
    def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)

    def dequantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return (x.float() * scale).to(self.compute_dtype)
