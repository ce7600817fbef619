"""CPU attention (also the test oracle on GPU): gather KV by location, then matmuls / SDPA.

Decode (every query one token) runs as one SDPA over a padded [kv_heads, B, L, D] copy of the
batch's KV, the query heads of each KV head as its "query rows", with a key-padding mask. Across
consecutive pure-decode steps over the same requests that copy is kept per layer and only the new
token is appended, so the KV that did not change is not gathered again (the gather was ~12% of a
decode step in float32); when it must grow, the kept KV is copied over, not gathered again.
Multi-token queries (prefill/extend) run one SDPA per request in float32; a fresh prefill skips
the gather and attends over the new K/V directly. Every SDPA call has the 4-D shapes that torch's
CPU flash kernel takes (notes/cpu-throughput.md has the measurements).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvledger.engine.attention.base import AttentionBackend, AttentionBatch
from kvledger.engine.model.kv_pool import KVPool

_WS_ALIGN = 64  # decode workspace length grows in these steps, so appends rarely force a rebuild


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
    locs: torch.Tensor  # [Bd, L] padded locations (padding 0)
    keep: torch.Tensor  # [1, Bd, 1, L] bool, False where the key is padding
    new_pos: torch.Tensor  # [Bd] position of each request's new token (seq_len - 1)
    batch: int
    max_len: int
    append: bool = False  # the kept workspace holds positions < new_pos: write only the new token


class TorchNativeBackend(AttentionBackend):
    def __init__(self, max_workspace_bytes: int = 1 << 30) -> None:
        self._decode: _Decode | None = None
        self._extends: list[_Extend] = []
        self._out_loc: torch.Tensor | None = None
        self.max_workspace_bytes = max_workspace_bytes
        # Per-layer decode KV kept across decode steps: [kv_heads, Bd, cap, head_dim] each, and the
        # locations they hold ([Bd, cap], -1 where empty). Empty lists when not in use.
        self._ws_k: list[torch.Tensor] = []
        self._ws_v: list[torch.Tensor] = []
        self._ws_locs: torch.Tensor | None = None
        self._ws_keep: torch.Tensor | None = None  # this step's key mask over the workspace capacity
        self._ws_append_idx: torch.Tensor | None = None  # [Bd] flat (row, position) of each new token

    # -- per step -----------------------------------------------------------------------------
    def plan(self, batch: AttentionBatch) -> None:
        self._out_loc = batch.out_loc
        device = batch.locs.device
        starts = [0]
        for n in batch.q_lens[:-1]:
            starts.append(starts[-1] + n)
        dec = [i for i, n in enumerate(batch.q_lens) if n == 1]
        all_decode = len(dec) == batch.batch_size
        self._decode = None
        if dec:
            rows = None if all_decode else torch.tensor(dec, device=device)
            seq = torch.tensor([batch.seq_lens[i] for i in dec], device=device)
            max_len = int(max(batch.seq_lens[i] for i in dec))
            locs = batch.locs[:, :max_len] if all_decode else batch.locs[rows, :max_len]
            col = torch.arange(max_len, device=device)
            self._decode = _Decode(
                token_idx=None if all_decode else torch.tensor([starts[i] for i in dec], device=device),
                locs=locs,
                keep=(col[None, :] < seq[:, None])[None, :, None, :],
                new_pos=seq - 1,
                batch=len(dec),
                max_len=max_len,
            )
        self._extends = []
        for i, n in enumerate(batch.q_lens):
            if n == 1:
                continue
            cached, seq_len = batch.cached_lens[i], batch.seq_lens[i]
            mask = None
            if cached:
                q_pos = torch.arange(cached, seq_len, device=device)[:, None]
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos
            self._extends.append(_Extend(starts[i], n, cached, batch.locs[i, :seq_len], mask))
        self._plan_workspace(all_decode)

    def _plan_workspace(self, all_decode: bool) -> None:
        """Decide whether this step appends to the kept decode KV or refills it (or drops it).

        Only pure-decode steps keep it: between two of them the pool changes only at the tokens
        written by the first, which were appended. A row's kept KV is reused when its locations
        below the new token equal the kept ones (same request, or the same shared prefix pages).
        """
        d = self._decode
        self._ws_keep = self._ws_append_idx = None
        if d is None or not all_decode:
            self._drop_workspace()
            return
        old = self._ws_locs
        # Every kept position below the new tokens must lie inside the old capacity (max_len - 1
        # is the largest new position); the workspace may then grow by one alignment step.
        if old is not None and old.shape[0] == d.batch and d.max_len - 1 <= old.shape[1]:
            n = min(d.max_len, old.shape[1])
            col = torch.arange(n, device=d.locs.device)[None, :]
            below = col < d.new_pos[:, None]
            d.append = torch.equal(torch.where(below, d.locs[:, :n], -1), torch.where(below, old[:, :n], -1))
        if not d.append:
            self._drop_workspace()
        cap = -(-(d.max_len + 1) // _WS_ALIGN) * _WS_ALIGN
        if self._ws_locs is None:
            self._ws_locs = torch.full((d.batch, cap), -1, dtype=torch.long, device=d.locs.device)
        elif self._ws_locs.shape[1] < d.max_len:  # grow; the layers' KV grows in _decode_kv
            grown = torch.full((d.batch, cap), -1, dtype=torch.long, device=d.locs.device)
            grown[:, : self._ws_locs.shape[1]] = self._ws_locs
            self._ws_locs = grown
        col = torch.arange(d.max_len, device=d.locs.device)[None, :]
        self._ws_locs[:, : d.max_len] = torch.where(col <= d.new_pos[:, None], d.locs, -1)
        cap = self._ws_locs.shape[1]
        if d.append:
            self._ws_append_idx = torch.arange(d.batch, device=d.locs.device) * cap + d.new_pos

    def _drop_workspace(self) -> None:
        self._ws_k, self._ws_v, self._ws_locs = [], [], None

    # -- per layer ----------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, pool: KVPool) -> torch.Tensor:
        assert self._out_loc is not None, "plan() first"
        pool.store(layer, self._out_loc, k, v)
        if pool.quantized:  # attend over what the pool holds, as the GPU kernels do
            k, v = pool.round_trip(layer, k, v)
        d = self._decode
        if d is not None and d.token_idx is None and not self._extends:
            kd, vd, keep = self._decode_kv(k, v, layer, pool, d)
            return _decode_attention(q, kd, vd, keep)
        out = torch.empty_like(q)
        if d is not None:
            kd, vd = pool.gather(layer, d.locs.reshape(-1))
            kd = kd.view(kd.shape[0], d.batch, d.max_len, kd.shape[-1])
            vd = vd.view(vd.shape[0], d.batch, d.max_len, vd.shape[-1])
            out[d.token_idx] = _decode_attention(q[d.token_idx], kd, vd, d.keep)
        for e in self._extends:
            sl = slice(e.start, e.start + e.q_len)
            if e.mask is None:
                out[sl] = _sdpa(q[sl], k[sl].transpose(0, 1), v[sl].transpose(0, 1), None)
            else:
                ke, ve = pool.gather(layer, e.locs)
                out[sl] = _sdpa(q[sl], ke, ve, e.mask)
        return out

    def _decode_kv(
        self, k: torch.Tensor, v: torch.Tensor, layer: int, pool: KVPool, d: _Decode
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This layer's decode KV as [kv_heads, B, L, head_dim] plus its [1, B, 1, L] key mask.

        With the kept workspace L is its whole capacity: attention then reads contiguous
        tensors (a [:max_len] slice made the matmuls copy their inputs: 2x slower). The columns
        past a request's length are masked; they hold zeros or stale but finite KV (never
        uninitialized memory: a NaN there would survive a zero probability).
        """
        assert self._ws_locs is not None
        cap = self._ws_locs.shape[1]
        kv_heads, dim = pool.k[layer].shape[0], pool.k[layer].shape[-1]
        per_layer = 2 * kv_heads * d.batch * cap * dim * pool.compute_dtype.itemsize
        if per_layer * len(pool.k) > self.max_workspace_bytes:  # too big to keep: gather every step
            kd, vd = pool.gather(layer, d.locs.reshape(-1))
            shape = (kv_heads, d.batch, d.max_len, dim)
            return kd.view(shape), vd.view(shape), d.keep
        if not self._ws_k:
            self._ws_k = [None] * len(pool.k)  # type: ignore[list-item]
            self._ws_v = [None] * len(pool.k)  # type: ignore[list-item]
        ws_k, ws_v = self._ws_k[layer], self._ws_v[layer]
        shape = (kv_heads, d.batch, cap, dim)
        if d.append and ws_k is not None:
            if ws_k.shape[2] != cap:  # grown: carry the kept KV over
                ws_k = self._ws_k[layer] = _grown(ws_k, shape)
                ws_v = self._ws_v[layer] = _grown(ws_v, shape)
            flat, append_idx = (kv_heads, d.batch * cap, dim), self._ws_append_idx
            assert append_idx is not None  # planned with the workspace (d.append)
            ws_k.view(flat).index_copy_(1, append_idx, k.transpose(0, 1).to(ws_k.dtype))
            ws_v.view(flat).index_copy_(1, append_idx, v.transpose(0, 1).to(ws_v.dtype))
        else:
            if ws_k is None or ws_k.shape != shape:
                ws_k = self._ws_k[layer] = pool.k[layer].new_empty(shape, dtype=pool.compute_dtype)
                ws_v = self._ws_v[layer] = pool.v[layer].new_empty(shape, dtype=pool.compute_dtype)
            kd, vd = pool.gather(layer, d.locs.reshape(-1))
            ws_k[:, :, : d.max_len] = kd.view(kv_heads, d.batch, d.max_len, dim)
            ws_v[:, :, : d.max_len] = vd.view(kv_heads, d.batch, d.max_len, dim)
            ws_k[:, :, d.max_len :] = 0
            ws_v[:, :, d.max_len :] = 0
        if self._ws_keep is None:
            col = torch.arange(cap, device=k.device)
            self._ws_keep = (col[None, :] <= d.new_pos[:, None])[None, :, None, :]
        return ws_k, ws_v, self._ws_keep


def _grown(ws: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """ws [kv_heads, B, cap, D] copied into zeros of a larger capacity."""
    out = ws.new_empty(shape)
    out[:, :, : ws.shape[2]] = ws
    out[:, :, ws.shape[2] :] = 0
    return out


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """q [B, H, D] (one token per request) over k, v [Hkv, B, L, D]; keep [1, B, 1, L] False to skip.

    Grouped-query attention as one SDPA with (Hkv, B) as batch dims: query head h reads KV head
    h // G (G = H / Hkv), so the G query heads of a KV head are its G query rows. The softmax runs
    in float32 inside the kernel whatever the KV dtype (the probabilities are then rounded to it,
    as the matmul form did). In float32 this is ~30% faster than matmul, mask, softmax, matmul
    as separate ops (they each made a pass over [Hkv, B, G, L]); in bfloat16 about as fast.
    """
    b, heads, dim = q.shape
    kv_heads = k.shape[0]
    qg = q.view(b, kv_heads, heads // kv_heads, dim).transpose(0, 1).to(k.dtype)  # [Hkv, B, G, D]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=keep)  # [Hkv, B, G, D]
    return out.permute(1, 0, 2, 3).reshape(b, heads, dim).to(q.dtype)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One request: q [Q, H, D], k/v [Hkv, S, D]; causal when mask is None (then Q == S).

    Runs in float32. The inputs are 4-D with the KV heads repeated to H, which is what torch's CPU
    flash kernel takes; 3-D inputs or `enable_gqa` sent every call to the unfused math path (QK^T,
    mask, softmax, PV as separate ops over the whole square): 2x slower on the default bench
    workload. (The flash kernel in bfloat16 is ~10% faster than this upcast but rounds the
    probabilities to bfloat16 first: ~4x the error, for ~1% of a bfloat16 run.)
    """
    group = q.shape[1] // k.shape[0]
    k, v = k.float(), v.float()
    if group > 1:
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).float()[None], k[None], v[None], attn_mask=mask, is_causal=mask is None
    )
    return o[0].transpose(0, 1).to(q.dtype)
