"""Llama / Qwen3 decoder over a flat batch of tokens, with paged KV through an attention backend."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from kvledger.engine.attention.base import AttentionBackend, AttentionBatch
from kvledger.engine.attention.torch_native import TorchNativeBackend
from kvledger.engine.distributed.group import TensorParallelGroup
from kvledger.engine.model import fused_ops
from kvledger.engine.model.config import ModelConfig
from kvledger.engine.model.kernels import StepInputs
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
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if config.qk_norm:  # Qwen3 normalizes each head of q and k before rope
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        o = step.kernels.attention(self, x, step)
        return self.tp.all_reduce(self.o_proj(o.reshape(x.shape[0], self.q_size)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer, tp)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, len(tp.shard.intermediate(config)), tp)
        self.tp = tp

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, step: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); their sum is the
        layer's output, which the next layer's norm (or the final one) adds."""
        kernels = step.kernels
        h, residual = kernels.add_norm(x, residual, self.input_norm)
        h, residual = kernels.add_norm(self.attn(h, step), residual, self.post_attn_norm)
        return self.tp.all_reduce(self.mlp.down_proj(kernels.silu_mul(self.mlp.gate_up_proj(h)))), residual


class CausalLM(nn.Module):
    """forward() runs one engine step; set `kv_pool` (and optionally `attn_backend`) first.

    Under tensor parallelism (`tp` of more than one rank) this is one rank's shard
    (engine/distributed/partition.py says which): its logits are still the whole vocabulary's."""

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend | None = None, tp: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = tp or TensorParallelGroup()
        vocab = tp.shard.vocab(config)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, vocab, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = LMHead(
            config.vocab_size,
            config.hidden_size,
            tie_to=self.embed_tokens if config.tie_word_embeddings else None,
            rows=vocab,
            tp=tp,
        )
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.attn_backend = attn_backend or TorchNativeBackend()
        self.kv_pool: KVPool | None = None

    @property
    def attn_backend(self) -> AttentionBackend:
        return self._attn_backend

    @attn_backend.setter
    def attn_backend(self, backend: AttentionBackend) -> None:
        attn = cast(DecoderLayer, self.layers[0]).attn if len(self.layers) else None
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
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_loc: torch.Tensor,
        last_token_idx: torch.Tensor | None = None,
        float_logits: bool = True,
    ) -> torch.Tensor:
        """The step after the backend's plan: only device tensors, so a CUDA graph can capture it.

        Logits [T, vocab] float32, or [B, vocab] for the rows in last_token_idx; in the model's
        dtype with float_logits=False (the decode graphs: their argmax is the same, and a
        float32 copy of every row costs a pass over [B, vocab] that only sampled rows need).
        """
        x = self.embed_tokens(input_ids)
        step = StepInputs.build(self, positions, out_loc, x.dtype)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, step)
        if last_token_idx is not None:
            x = x[last_token_idx]
            residual = None if residual is None else residual[last_token_idx]
        x, _ = step.kernels.add_norm(x, residual, self.norm)
        logits = self.lm_head(x)
        return logits.float() if float_logits else logits
