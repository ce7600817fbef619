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
    def _attend_block(
        q,
        K,
        V,
        table_row,
        n0,
        end,
        head_off,
        stride_kn,
        sm_scale,
        m_i,
        l_i,
        acc,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
        DOT: tl.constexpr,
        q_pos,
        CAUSAL: tl.constexpr,
        MASKED: tl.constexpr,
        NARROW: tl.constexpr,
    ):
        """One block of keys n0 + [0, BLOCK_N): MASKED for a block that may run past `end`."""
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        if MASKED:
            loc = tl.load(table_row + offs_n, mask=n_mask, other=0)
        else:
            loc = tl.load(table_row + offs_n)
        if not NARROW:
            loc = loc.to(tl.int64)
        kv_off = loc[:, None] * stride_kn + head_off + offs_d[None, :]
        if MASKED:
            k = tl.load(K + kv_off, mask=n_mask[:, None], other=0.0)
        else:
            k = tl.load(K + kv_off)
        k = k.to(DOT)  # e4m3 -> fp16 is one instruction on Hopper; K's scale is in sm_scale
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * sm_scale
        if MASKED or CAUSAL:
            keep = n_mask[None, :]
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= q_pos[:, None])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(V + kv_off, mask=n_mask[:, None], other=0.0)
        else:
            v = tl.load(V + kv_off)
        v = v.to(DOT)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        return m_new, l_i, acc

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
        MASK_TAIL_ONLY: tl.constexpr = False,
        NARROW: tl.constexpr = False,
    ):
        """q [ROWS, HEAD_DIM] (in DOT) over keys table_row[start:end] of the KV head at head_off.
        CAUSAL: row r sees only keys at positions <= q_pos[r] (a row may see none in a block).
        MASK_TAIL_ONLY: the whole blocks run without bounds masks and only a last partial block
        with them (fewer instructions and registers per block). NARROW: token offsets into the
        pool fit in int32 (a pool of fewer than 2**31 elements per layer)."""
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        if MASK_TAIL_ONLY:
            whole_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
            for n0 in range(start, whole_end, BLOCK_N):
                m_i, l_i, acc = _attend_block(
                    q, K, V, table_row, n0, end, head_off, stride_kn, sm_scale, m_i, l_i, acc,
                    HEAD_DIM, BLOCK_N, PRECISION, DOT, q_pos, CAUSAL, False, NARROW,
                )  # fmt: skip
            if whole_end < end:
                m_i, l_i, acc = _attend_block(
                    q, K, V, table_row, whole_end, end, head_off, stride_kn, sm_scale, m_i, l_i, acc,
                    HEAD_DIM, BLOCK_N, PRECISION, DOT, q_pos, CAUSAL, True, NARROW,
                )  # fmt: skip
        else:
            for n0 in range(start, end, BLOCK_N):
                m_i, l_i, acc = _attend_block(
                    q, K, V, table_row, n0, end, head_off, stride_kn, sm_scale, m_i, l_i, acc,
                    HEAD_DIM, BLOCK_N, PRECISION, DOT, q_pos, CAUSAL, True, NARROW,
                )  # fmt: skip
        return m_i, l_i, acc

    @triton.jit
    def finish_partial(m_i, l_i, acc, v_scale):
        """(output normalized by its own sum, log-sum-exp); an empty range gives (0, -inf)."""
        empty = l_i == 0.0
        out = acc * v_scale / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        return out, lse
