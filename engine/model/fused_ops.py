"""Triton kernels that fuse a decoder layer's elementwise work (CUDA path).

In eager PyTorch one decoder layer is ~45 small kernels (norms in float32, rotary halves, casts,
the KV stores); at decode batch sizes each takes a few microseconds, which for a 28-layer model is
milliseconds per step even inside a CUDA graph. These three kernels cut a layer to ~10 launches:

- `add_rmsnorm`: residual add + RMSNorm, one program per token;
- `qk_norm_rope_store`: one program per token, all its heads at once: optional RMSNorm of q/k
  (Qwen3), rotary on q and k, and the k/v store into the KV pool at the step's token locations;
  returns q;
- `silu_mul`: SiLU(gate) * up of the fused gate/up projection.

The numerics follow the torch modules in engine/layers (float32 statistics, rounding to the model
dtype at the same points), so the CPU path stays the reference they are tested against.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:

    @triton.jit
    def _add_rmsnorm_kernel(
        X,
        RES,
        W,
        OUT,
        RES_OUT,
        stride_x,
        stride_r,
        stride_o,
        stride_ro,
        N,
        eps,
        HAS_RES: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_RES:
            x = x.to(tl.float32) + tl.load(RES + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
            x = x.to(OUT.dtype.element_ty)
            tl.store(RES_OUT + row * stride_ro + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        y = (xf * rstd).to(OUT.dtype.element_ty).to(tl.float32) * w
        tl.store(OUT + row * stride_o + offs, y.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _qk_norm_rope_store_kernel(
        QKV,
        POS,
        INV_FREQ,
        QN_W,
        KN_W,
        Q_OUT,
        K_CACHE,
        V_CACHE,
        OUT_LOC,
        stride_t,
        stride_qt,
        stride_qh,
        stride_kn,
        stride_kh,
        eps,
        k_scale,
        v_scale,
        HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        ROWS_PAD: tl.constexpr,
        KV_PAD: tl.constexpr,
        HALF: tl.constexpr,
        QK_NORM: tl.constexpr,
        FP8: tl.constexpr,
    ):
        # one program per token, every head at once: rows [0, HEADS) are the query heads, then
        # [HEADS, HEADS + KV_HEADS) the key heads, which follow them in the qkv row; the rotary
        # angles are computed once per token, not once per head
        t = tl.program_id(0)
        rows = tl.arange(0, ROWS_PAD)
        offs = tl.arange(0, HALF)
        is_k = (rows >= HEADS)[:, None]
        row_mask = (rows < HEADS + KV_HEADS)[:, None]
        base = QKV + t * stride_t + rows[:, None] * (2 * HALF) + offs[None, :]
        x1 = tl.load(base, mask=row_mask, other=0.0)
        x2 = tl.load(base + HALF, mask=row_mask, other=0.0)
        dtype = x1.dtype
        if QK_NORM:
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / (2 * HALF) + eps)
            kw1, kw2 = tl.load(KN_W + offs)[None, :], tl.load(KN_W + HALF + offs)[None, :]
            qw1, qw2 = tl.load(QN_W + offs)[None, :], tl.load(QN_W + HALF + offs)[None, :]
            w1 = tl.where(is_k, kw1, qw1).to(tl.float32)
            w2 = tl.where(is_k, kw2, qw2).to(tl.float32)
            x1 = ((f1 * rstd[:, None]).to(dtype).to(tl.float32) * w1).to(dtype)
            x2 = ((f2 * rstd[:, None]).to(dtype).to(tl.float32) * w2).to(dtype)
        pos = tl.load(POS + t).to(tl.float32)
        freq = pos * tl.load(INV_FREQ + offs)
        cos = tl.cos(freq).to(dtype).to(tl.float32)[None, :]
        sin = tl.sin(freq).to(dtype).to(tl.float32)[None, :]
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        # torch rounds each product and the sum to the model dtype; do the same
        o1 = ((a * cos).to(dtype).to(tl.float32) + (-(b * sin)).to(dtype).to(tl.float32)).to(dtype)
        o2 = ((b * cos).to(dtype).to(tl.float32) + (a * sin).to(dtype).to(tl.float32)).to(dtype)
        q_mask = rows[:, None] < HEADS
        q_base = Q_OUT + t * stride_qt + rows[:, None] * stride_qh + offs[None, :]
        tl.store(q_base, o1, mask=q_mask)
        tl.store(q_base + HALF, o2, mask=q_mask)

        loc = tl.load(OUT_LOC + t).to(tl.int64)
        k_mask = is_k & row_mask
        k_dst = K_CACHE + loc * stride_kn + (rows[:, None] - HEADS) * stride_kh + offs[None, :]
        kv_rows = tl.arange(0, KV_PAD)
        v_mask = (kv_rows < KV_HEADS)[:, None]
        v_src = QKV + t * stride_t + (HEADS + KV_HEADS + kv_rows[:, None]) * (2 * HALF) + offs[None, :]
        v_dst = V_CACHE + loc * stride_kn + kv_rows[:, None] * stride_kh + offs[None, :]
        k1, k2 = o1.to(tl.float32), o2.to(tl.float32)  # exact for the model dtypes
        w1 = tl.load(v_src, mask=v_mask, other=0.0).to(tl.float32)
        w2 = tl.load(v_src + HALF, mask=v_mask, other=0.0).to(tl.float32)
        if FP8:  # x / scale, clamped to e4m3's range (a cast past 448 would be NaN)
            k1 = tl.minimum(tl.maximum(k1 / k_scale, -448.0), 448.0)
            k2 = tl.minimum(tl.maximum(k2 / k_scale, -448.0), 448.0)
            w1 = tl.minimum(tl.maximum(w1 / v_scale, -448.0), 448.0)
            w2 = tl.minimum(tl.maximum(w2 / v_scale, -448.0), 448.0)
        tl.store(k_dst, k1.to(K_CACHE.dtype.element_ty), mask=k_mask)
        tl.store(k_dst + HALF, k2.to(K_CACHE.dtype.element_ty), mask=k_mask)
        tl.store(v_dst, w1.to(V_CACHE.dtype.element_ty), mask=v_mask)
        tl.store(v_dst + HALF, w2.to(V_CACHE.dtype.element_ty), mask=v_mask)

    @triton.jit
    def _silu_mul_kernel(GU, OUT, stride_g, stride_o, N, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        gate = tl.load(GU + row * stride_g + offs, mask=mask, other=0.0)
        up = tl.load(GU + row * stride_g + N + offs, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        tl.store(OUT + row * stride_o + offs, (silu * up.to(tl.float32)).to(OUT.dtype.element_ty), mask=mask)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rmsnorm(x + residual) * weight, x + residual); residual None means zero."""
    rows, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    _add_rmsnorm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        res_out,
        x.stride(0),
        (residual if residual is not None else x).stride(0),
        out.stride(0),
        res_out.stride(0),
        n,
        eps,
        HAS_RES=residual is not None,
        BLOCK=triton.next_power_of_2(n),
    )
    return out, res_out


def qk_norm_rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    heads: int,
    kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    token_dim: int,
    out_loc: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """qkv [T, (heads + 2 kv_heads) * D] -> rotated q [T, heads, D]; k (rotated) and v go to the
    cache layer at out_loc. k_cache/v_cache: [tokens, kv_heads, D] or [kv_heads, tokens, D], in
    qkv's dtype or FP8 (e4m3: stored as k / k_scale and v / v_scale)."""
    t = qkv.shape[0]
    head_dim = qkv.shape[1] // (heads + 2 * kv_heads)
    q = torch.empty(t, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    qk_norm = q_norm_weight is not None
    _qk_norm_rope_store_kernel[(t,)](
        qkv,
        positions,
        inv_freq,
        q_norm_weight if qk_norm else inv_freq,
        k_norm_weight if qk_norm else inv_freq,
        q,
        k_cache,
        v_cache,
        out_loc,
        qkv.stride(0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(token_dim),
        k_cache.stride(1 - token_dim),
        eps,
        k_scale,
        v_scale,
        HEADS=heads,
        KV_HEADS=kv_heads,
        ROWS_PAD=triton.next_power_of_2(heads + kv_heads),
        KV_PAD=triton.next_power_of_2(kv_heads),
        HALF=head_dim // 2,
        QK_NORM=qk_norm,
        FP8=k_cache.dtype == torch.float8_e4m3fn,
    )
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block)
    return out
