"""The two kernel sets a decoder layer runs on, chosen once per step: eager PyTorch, or the fused
Triton kernels (CUDA with Triton and a backend that attends over already-stored KV).

Both compute the same thing in the same order. Each layer's residual stream is carried beside its
output and added by the next norm (`add_norm`), the form the fused kernels need; in eager
PyTorch it is the same additions as `x = x + f(norm(x))`. Eager attention rotates q and k with
precomputed cos/sin and lets the backend store K/V; fused attention normalizes, rotates and stores
in one kernel, then the backend reads the stored KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvledger.engine.attention.base import AttentionBackend
from kvledger.engine.model import fused_ops
from kvledger.engine.model.kv_pool import KVPool
from kvledger.engine.model.layers import RMSNorm, RotaryEmbedding

if TYPE_CHECKING:
    from kvledger.engine.model.model import Attention, CausalLM


class EagerKernels:
    @staticmethod
    def add_norm(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x if residual is None else residual + x
        return norm(residual), residual

    @staticmethod
    def attention(attn: Attention, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.view(t, attn.num_heads, attn.head_dim)
        k = k.view(t, attn.num_kv_heads, attn.head_dim)
        v = v.view(t, attn.num_kv_heads, attn.head_dim)
        if attn.q_norm is not None and attn.k_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = step.cos, step.sin
        assert cos is not None and sin is not None  # an eager step carries the rotary tables
        q, k = RotaryEmbedding.rotate(q, cos, sin), RotaryEmbedding.rotate(k, cos, sin)
        return step.backend.forward(q, k, v, attn.layer, step.pool)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class FusedKernels:
    @staticmethod
    def add_norm(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_ops.add_rmsnorm(x, residual, norm.weight, norm.eps)

    @staticmethod
    def attention(attn: Attention, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        pool, inv_freq = step.pool, step.inv_freq
        assert inv_freq is not None  # a fused step carries the rotary frequencies
        q = fused_ops.qk_norm_rope_store(
            attn.qkv_proj(x),
            step.positions,
            inv_freq,
            attn.q_norm.weight if attn.q_norm is not None else None,
            attn.k_norm.weight if attn.k_norm is not None else None,
            attn.q_norm.eps if attn.q_norm is not None else 0.0,
            attn.num_heads,
            attn.num_kv_heads,
            pool.k[attn.layer],
            pool.v[attn.layer],
            pool.token_dim,
            step.out_loc,
            pool.k_scale[attn.layer],
            pool.v_scale[attn.layer],
        )
        return step.backend.forward_stored(q, attn.layer, pool)

    silu_mul = staticmethod(fused_ops.silu_mul)


@dataclass
class StepInputs:
    """What every layer of one step reads besides its input: the kernel set and the step's
    positions, KV locations, rotary tables, attention backend and KV pool."""

    kernels: type[EagerKernels] | type[FusedKernels]
    positions: torch.Tensor
    out_loc: torch.Tensor
    backend: AttentionBackend
    pool: KVPool
    cos: torch.Tensor | None = None  # eager: [T, 1, head_dim]
    sin: torch.Tensor | None = None
    inv_freq: torch.Tensor | None = None  # fused: the kernel computes the angles itself

    @classmethod
    def build(cls, model: CausalLM, positions: torch.Tensor, out_loc: torch.Tensor, dtype: torch.dtype) -> StepInputs:
        backend, pool = model.attn_backend, model.kv_pool
        if pool is None:
            raise RuntimeError("assign model.kv_pool before calling forward")
        if model.uses_fused_path():
            rotary = model.rotary
            if rotary.inv_freq.device != positions.device:
                rotary.inv_freq = rotary.inv_freq.to(positions.device)
            return cls(FusedKernels, positions, out_loc, backend, pool, inv_freq=rotary.inv_freq)
        cos, sin = model.rotary.cos_sin(positions, dtype)
        return cls(EagerKernels, positions, out_loc, backend, pool, cos=cos, sin=sin)
