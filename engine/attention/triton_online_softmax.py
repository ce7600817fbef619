"""The online-softmax loop that the decode kernels share, as Triton device functions (inlined).

`attend_locations` streams keys and values at the token locations table_row[start:end] for a
tile of query rows (causally for prefill and extend) and returns the running max, sum and
unnormalized output; `finish_partial` turns them into a partial output normalized by its own sum
plus its log-sum-exp, which a merge combines with other partials over disjoint key ranges.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def attend_locations(
        q,
        K,
        V,
        table_row,
        start,
        end,
        head_off,
        stride_kn,
        sm_scale,
        ROWS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
        DOT: tl.constexpr,
        q_pos=0,
        CAUSAL: tl.constexpr = False,
    ):
        """q [ROWS, HEAD_DIM] (in DOT) over keys table_row[start:end] of the KV head at head_off.
        CAUSAL: row r sees only keys at positions <= q_pos[r] (a row may see none in a block)."""
        offs_d = tl.arange(0, HEAD_DIM)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            loc = tl.load(table_row + offs_n, mask=n_mask, other=0).to(tl.int64)
            kv_off = loc[:, None] * stride_kn + head_off + offs_d[None, :]
            k = tl.load(K + kv_off, mask=n_mask[:, None], other=0.0)
            k = k.to(DOT)  # e4m3 -> fp16 is one instruction on Hopper; K's scale is in sm_scale
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * sm_scale
            keep = n_mask[None, :]
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= q_pos[:, None])
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + kv_off, mask=n_mask[:, None], other=0.0)
            v = v.to(DOT)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def finish_partial(m_i, l_i, acc, v_scale):
        """(output normalized by its own sum, log-sum-exp); an empty range gives (0, -inf)."""
        empty = l_i == 0.0
        out = acc * v_scale / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        return out, lse
