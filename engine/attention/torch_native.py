"""CPU attention (also the test oracle on GPU): gather KV by location, then SDPA.

Single-token queries (decode) are batched: one padded gather of every request's KV plus a
key-padding mask. Multi-token queries (prefill/extend) run one SDPA per request; a fresh
prefill skips the gather and attends over the new K/V directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionBatch
from engine.kv_pool import KVPool


@dataclass
class _Extend:
    start: int  # first token in the flat batch
    q_len: int
    cached_len: int
    locs: torch.Tensor  # [seq_len]
    mask: torch.Tensor | None  # [q_len, seq_len] bool, None for a fresh causal prefill


@dataclass
class _Decode:
    token_idx: torch.Tensor | None  # [Bd] rows of the flat batch, None when the whole batch decodes
    locs: torch.Tensor  # [Bd * L] flattened padded locations
    mask: torch.Tensor  # [Bd, 1, 1, L] bool, True where the key is real
    batch: int
    max_len: int


class TorchNativeBackend(AttentionBackend):
    def __init__(self) -> None:
        self._decode: _Decode | None = None
        self._extends: list[_Extend] = []
        self._out_loc: torch.Tensor | None = None
        # Decode gathers land in reused buffers: allocating (and page-faulting) tens of MB per layer
        # made the gather ~5x slower than the copy itself on CPU.
        self._k_ws = self._v_ws = torch.empty(0)

    def plan(self, batch: AttentionBatch) -> None:
        self._out_loc = batch.out_loc
        starts = [0]
        for n in batch.q_lens[:-1]:
            starts.append(starts[-1] + n)
        dec = [i for i, n in enumerate(batch.q_lens) if n == 1]
        self._decode = None
        if dec:
            device = batch.locs.device
            all_decode = len(dec) == batch.batch_size
            rows = None if all_decode else torch.tensor(dec, device=device)
            seq = torch.tensor([batch.seq_lens[i] for i in dec], device=device)
            max_len = int(max(batch.seq_lens[i] for i in dec))
            locs = batch.locs[:, :max_len] if all_decode else batch.locs[rows, :max_len]
            mask = torch.arange(max_len, device=device)[None, :] < seq[:, None]
            self._decode = _Decode(
                token_idx=None if all_decode else torch.tensor([starts[i] for i in dec], device=device),
                locs=locs.reshape(-1),
                mask=mask[:, None, None, :],
                batch=len(dec),
                max_len=max_len,
            )
        self._extends = []
        for i, n in enumerate(batch.q_lens):
            if n == 1:
                continue
            cached, seq = batch.cached_lens[i], batch.seq_lens[i]
            mask = None
            if cached:
                q_pos = torch.arange(cached, seq, device=batch.locs.device)[:, None]
                mask = torch.arange(seq, device=batch.locs.device)[None, :] <= q_pos
            self._extends.append(_Extend(starts[i], n, cached, batch.locs[i, :seq], mask))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, pool: KVPool) -> torch.Tensor:
        pool.store(layer, self._out_loc, k, v)
        k_cache, v_cache = pool.k[layer], pool.v[layer]
        d = self._decode
        if d is not None and d.token_idx is None and not self._extends:
            return self._decode_attn(q, k_cache, v_cache, d)
        out = torch.empty_like(q)
        if d is not None:
            out[d.token_idx] = self._decode_attn(q[d.token_idx], k_cache, v_cache, d)
        for e in self._extends:
            sl = slice(e.start, e.start + e.q_len)
            if e.mask is None:
                out[sl] = _sdpa(q[sl], k[sl], v[sl], None)
            else:
                out[sl] = _sdpa(q[sl], k_cache[e.locs], v_cache[e.locs], e.mask)
        return out

    def _gather(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, locs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the layer's K/V at locs, as [len(locs), kv_heads, head_dim] views of the workspace."""
        n, row = locs.numel(), k_cache[0].numel()
        if self._k_ws.numel() < n * row or self._k_ws.dtype != k_cache.dtype or self._k_ws.device != k_cache.device:
            self._k_ws = k_cache.new_empty(n * row)
            self._v_ws = v_cache.new_empty(n * row)
        k = self._k_ws[: n * row].view(n, row)
        v = self._v_ws[: n * row].view(n, row)
        torch.index_select(k_cache.view(-1, row), 0, locs, out=k)
        torch.index_select(v_cache.view(-1, row), 0, locs, out=v)
        return k.view(n, *k_cache.shape[1:]), v.view(n, *v_cache.shape[1:])

    def _decode_attn(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, d: _Decode) -> torch.Tensor:
        b, heads, dim = q.shape
        kv_heads = k_cache.shape[1]
        k, v = self._gather(k_cache, v_cache, d.locs)
        # [B*L, Hkv, D] -> [B, Hkv, L, D]
        k = k.view(b, d.max_len, kv_heads, dim).transpose(1, 2)
        v = v.view(b, d.max_len, kv_heads, dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.view(b, heads, 1, dim).to(k.dtype), k, v, attn_mask=d.mask, enable_gqa=heads != kv_heads
        )
        return o.view(b, heads, dim).to(q.dtype)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One request: q [Q, H, D], k/v [S, Hkv, D]; causal when mask is None (then Q == S)."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).to(k.dtype),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return o.transpose(0, 1).to(q.dtype)
