"""Split-KV decode attention over the page table, in two Triton kernels (CUDA-graph safe).

Stage 1: one program per (request, KV head, split) walks its slice of the request's token
locations straight from the request-to-token table (no gathered copy), with every query head of
that KV head's group at once (GQA: the group shares each loaded K/V block), and writes a partial
output normalized by its own softmax sum plus the log-sum-exp. Stage 2: one program per (request,
query head) merges the splits. Splitting keeps the GPU busy when few requests have long contexts.

Everything the kernels need is on the device (table rows, sequence lengths), so a captured graph
replays them with new metadata copied into the same buffers; no host value enters the launch
except the batch size and the split count, which are fixed per captured graph.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _decode_attention_split_kernel(
        Q, K, V, TABLE, ROWS, SEQ_LEN, PART_O, PART_LSE,
        stride_qb, stride_qh, stride_kn, stride_kh, stride_tr,
        stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
        sm_scale, v_scale, PRECISION: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT: tl.constexpr,
    ):
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(SEQ_LEN + b)
        row = tl.load(ROWS + b).to(tl.int64)
        per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, seq_len)

        offs_g = tl.arange(0, GROUP_PAD)
        g_mask = offs_g < GROUP
        heads = kv_head * GROUP + offs_g
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None],
                    other=0.0).to(DOT)

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            loc = tl.load(TABLE + row * stride_tr + offs_n, mask=n_mask, other=0).to(tl.int64)
            kv_off = loc[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :]
            k = tl.load(K + kv_off, mask=n_mask[:, None], other=0.0)
            k = k.to(DOT)  # e4m3 -> fp16 is one instruction on Hopper; K's scale is in sm_scale
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * sm_scale
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + kv_off, mask=n_mask[:, None], other=0.0)
            v = v.to(DOT)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            m_i = m_new
        empty = l_i == 0.0  # a split past the end of a short request
        out = acc * v_scale / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        base = b * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(PART_O + base[:, None] + offs_d[None, :], out, mask=g_mask[:, None])
        tl.store(PART_LSE + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)

    @triton.jit
    def _decode_attention_merge_kernel(
        PART_O, PART_LSE, O, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
        HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    ):
        b = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, NUM_SPLITS)
        offs_d = tl.arange(0, HEAD_DIM)
        lse = tl.load(PART_LSE + b * stride_lb + head * stride_lh + offs_s)
        weight = tl.exp(lse - tl.max(lse, 0))  # split 0 is never empty: the max is finite
        weight = weight / tl.sum(weight, 0)
        part = tl.load(PART_O + b * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :])
        out = tl.sum(part * weight[:, None], 0)
        tl.store(O + b * stride_ob + head * stride_oh + offs_d, out.to(O.dtype.element_ty))


def dot_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype):
    """What the kernels' dot products take: the query's dtype, or fp16 over an FP8 cache (e4m3
    converts to fp16 in one instruction; to bf16 it goes through fp32, which made the kernel
    compute-bound)."""
    if kv_dtype == torch.float8_e4m3fn:
        return tl.float16
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[q_dtype]


def num_splits_for(batch_size: int, kv_heads: int, target_programs: int = 1024, max_splits: int = 16) -> int:
    """Enough splits that stage 1 has about `target_programs` programs (a power of two)."""
    want = max(1, -(-target_programs // max(1, batch_size * kv_heads)))
    splits = 1
    while splits < want and splits < max_splits:
        splits *= 2
    return splits


def decode_launch_config(batch_size: int, kv_heads: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) for stage 1. On the H200 (bf16) a per-layer sweep at fixed context
    lengths favoured 32-token blocks on 2 warps for large batches (6-10%), but over the whole
    nano-vllm workload that made Qwen3-0.6B's decode phase 5% slower (5.40 s vs 5.11 s) and
    SmolLM2's no faster, so one configuration it is."""
    return 64, 4


class DecodeWorkspace:
    """Partial outputs of stage 1 for up to `max_batch` requests: allocate once, reuse per layer."""

    def __init__(self, max_batch: int, heads: int, head_dim: int, max_splits: int, device: torch.device | str) -> None:
        self.part_o = torch.empty(max_batch, heads, max_splits, head_dim, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(max_batch, heads, max_splits, dtype=torch.float32, device=device)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    token_dim: int,
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    workspace: DecodeWorkspace,
    num_splits: int,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [B, heads, D] (each request's one new token, already stored in the cache) attends over
    the request's first seq_lens[b] tokens at table[rows[b], :seq_lens[b]].

    k_cache/v_cache: one layer's pool, [tokens, kv_heads, D] (token_dim 0) or [kv_heads, tokens, D]
    (token_dim 1), in q's dtype or FP8 (e4m3, read back as value * k_scale / v_scale).
    Returns [B, heads, D] in q's dtype.
    """
    if triton is None:
        raise RuntimeError("decode_attention needs the `triton` package")
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1 - token_dim]
    group = heads // kv_heads
    if num_splits & (num_splits - 1) or num_splits > workspace.part_o.shape[2]:
        raise ValueError(f"num_splits must be a power of two <= {workspace.part_o.shape[2]}, got {num_splits}")
    out = torch.empty_like(q) if out is None else out
    po, pl = workspace.part_o, workspace.part_lse
    _decode_attention_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, table, rows, seq_lens, po, pl,
        q.stride(0), q.stride(1), k_cache.stride(token_dim), k_cache.stride(1 - token_dim), table.stride(0),
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        head_dim ** -0.5 * k_scale, v_scale,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, DOT=dot_dtype(q.dtype, k_cache.dtype), num_warps=num_warps,
    )
    _decode_attention_merge_kernel[(batch, heads)](
        po, pl, out, po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
    )
    return out
