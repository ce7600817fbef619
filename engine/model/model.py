"""Llama / Qwen3 decoder over a flat batch of tokens, with paged KV through an attention backend."""

from __future__ import annotations

import torch
from torch import nn

from kvledger.engine.model import fused_ops
from kvledger.engine.attention.base import AttentionBackend, AttentionBatch
from kvledger.engine.attention.torch_native import TorchNativeBackend
from kvledger.engine.model.config import ModelConfig
from kvledger.engine.distributed.group import TensorParallelGroup
from kvledger.engine.model.kv_pool import KVPool
from kvledger.engine.model.layers import Embedding, GatedMLP, Linear, LMHead, RMSNorm, RotaryEmbedding


class Attention(nn.Module):
    """This rank's query heads and the KV heads they read (all of them without tensor parallelism);
    o_proj is split by rows, so its output is summed over the ranks."""

    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.layer, self.tp = layer, tp
        self.num_heads = len(tp.shard.heads(config))
        self.num_kv_heads = len(tp.shard.kv_heads(config))
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:  # Qwen3 normalizes each head of q and k before rope
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend, pool: KVPool
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        o = backend.forward(q, k, v, self.layer, pool)
        return self.tp.all_reduce(self.o_proj(o.reshape(t, self.q_size)))

    def forward_fused(
        self, x: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor, inv_freq: torch.Tensor,
        backend: AttentionBackend, pool: KVPool,
    ) -> torch.Tensor:
        """The CUDA path: norms, rotary and the KV store in one kernel, then attention over the pool."""
        qkv = self.qkv_proj(x)
        k_cache, v_cache = pool.k[self.layer], pool.v[self.layer]
        q = fused_ops.qk_norm_rope_store(
            qkv, positions, inv_freq, self.q_norm.weight if self.q_norm is not None else None,
            self.k_norm.weight if self.k_norm is not None else None,
            self.q_norm.eps if self.q_norm is not None else 0.0,
            self.num_heads, self.num_kv_heads, k_cache, v_cache, pool.token_dim, out_loc,
            pool.k_scale[self.layer], pool.v_scale[self.layer])
        o = backend.forward_stored(q, self.layer, pool)
        return self.tp.all_reduce(self.o_proj(o.reshape(x.shape[0], self.q_size)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer, tp)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, len(tp.shard.intermediate(config)), tp)

    def forward(self, x: torch.Tensor, cos, sin, backend: AttentionBackend, pool: KVPool) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, backend, pool)
        return x + self.mlp(self.post_attn_norm(x))

    def forward_fused(self, x, residual, positions, out_loc, inv_freq, backend, pool):
        """Returns (this layer's MLP output, the residual stream before it); their sum is the
        layer's output, added by the next layer's fused norm."""
        h, residual = fused_ops.add_rmsnorm(x, residual, self.input_norm.weight, self.input_norm.eps)
        x = self.attn.forward_fused(h, positions, out_loc, inv_freq, backend, pool)
        h, residual = fused_ops.add_rmsnorm(x, residual, self.post_attn_norm.weight, self.post_attn_norm.eps)
        return self.mlp.tp.all_reduce(self.mlp.down_proj(fused_ops.silu_mul(self.mlp.gate_up_proj(h)))), residual


class CausalLM(nn.Module):
    """forward() runs one engine step; set `kv_pool` (and optionally `attn_backend`) first.

    Under tensor parallelism (`tp` of more than one rank) this is one rank's shard
    (engine/distributed/partition.py says which): its logits are still the whole vocabulary's."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend | None = None,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = tp or TensorParallelGroup()
        vocab = tp.shard.vocab(config)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, vocab, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size,
                              tie_to=self.embed_tokens if config.tie_word_embeddings else None, rows=vocab, tp=tp)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.attn_backend = attn_backend or TorchNativeBackend()
        self.kv_pool: KVPool | None = None

    @property
    def attn_backend(self) -> AttentionBackend:
        return self._attn_backend

    @attn_backend.setter
    def attn_backend(self, backend: AttentionBackend) -> None:
        attn = self.layers[0].attn if len(self.layers) else None
        if attn is not None:
            backend.configure(attn.num_heads, attn.num_kv_heads, attn.head_dim)
        self._attn_backend = backend

    @classmethod
    def from_state_dict(
        cls,
        config: ModelConfig,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp: TensorParallelGroup | None = None,
    ) -> CausalLM:
        """`state`: this rank's shard of the weights under tensor parallelism."""
        with torch.device("meta"):
            model = cls(config, tp=tp)
        model.load_state_dict(state, strict=True, assign=True)
        model.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)  # built on meta above
        return model.to(device=device, dtype=dtype).eval()

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch, all_logits: bool = False
    ) -> torch.Tensor:
        """input_ids, positions: [T] for the batch's new tokens, request after request.

        Returns logits [B, vocab] for each request's last new token, or [T, vocab] with all_logits.
        """
        if self.kv_pool is None:
            raise RuntimeError("assign model.kv_pool before calling forward")
        self.attn_backend.plan(attn)
        last = None if all_logits or attn.is_decode else attn.last_token_idx
        return self.run(input_ids, positions, attn.out_loc, last)

    def uses_fused_path(self) -> bool:
        """CUDA with Triton and a backend that attends over already-stored KV."""
        return fused_ops.available(self.embed_tokens.weight) and self.attn_backend.reads_stored_kv

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor,
        last_token_idx: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The step after the backend's plan: only device tensors, so a CUDA graph can capture it.

        Logits [T, vocab] float32, or [B, vocab] for the rows in last_token_idx.
        """
        x = self.embed_tokens(input_ids)
        if self.uses_fused_path():
            inv_freq = self.rotary.inv_freq
            if inv_freq.device != x.device:
                inv_freq = self.rotary.inv_freq = inv_freq.to(x.device)
            residual = None
            for layer in self.layers:
                x, residual = layer.forward_fused(x, residual, positions, out_loc, inv_freq,
                                                  self.attn_backend, self.kv_pool)
            if last_token_idx is not None:
                x, residual = x[last_token_idx], residual[last_token_idx]
            x, _ = fused_ops.add_rmsnorm(x, residual, self.norm.weight, self.norm.eps)
            return self.lm_head(x).float()
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, self.attn_backend, self.kv_pool)
        if last_token_idx is not None:
            x = x[last_token_idx]
        return self.lm_head(self.norm(x)).float()
