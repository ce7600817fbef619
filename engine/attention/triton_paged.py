"""CUDA attention over the page table: one Triton kernel for prefill, chunked extend and decode.

Each program takes one request, one KV head and a block of that request's new tokens, with every
query head of the KV head's group in one tile (GQA: each K/V block is loaded once for the group;
a group whose size is not a power of two takes one query head per program),
and streams the request's keys and values straight from the KV pool through its token locations
(no gathered copy), with an online softmax. The new tokens' K/V are stored first, so prefix and
new tokens are read the same way; the causal mask is key position <= query position.
Query head h reads KV head h // (heads // kv_heads).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl

    from kvledger.engine.attention.triton_online_softmax import attend_locations
except ImportError:  # CPU-only installs: the backend is simply unavailable
    triton = None

from kvledger.engine.attention import cuda_fp8_decode, triton_decode
from kvledger.engine.attention.base import AttentionBackend, AttentionBatch
from kvledger.engine.attention.shared_prefix import PrefixGroups, find_prefix_groups, members_per_group
from kvledger.engine.attention.triton_decode import (
    DecodeWorkspace,
    decode_attention,
    longest_first,
    num_splits_for,
)
from kvledger.engine.model.kv_pool import KVPool

log = logging.getLogger(__name__)


class DecodePlan(NamedTuple):
    """A pure-decode step's metadata, on the device (`plan_decode`)."""

    table: torch.Tensor  # [rows, width] token locations
    rows: torch.Tensor  # [B] each request's table row
    seq_lens: torch.Tensor  # [B]
    num_splits: int
    order: torch.Tensor  # [B] the batch by descending length (`longest_first`): the launch order


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        Q,
        K,
        V,
        O,
        LOCS,
        Q_START,
        Q_LEN,
        SEQ_LEN,
        stride_qt,
        stride_qh,
        stride_kn,
        stride_kh,
        stride_ot,
        stride_oh,
        stride_lb,
        sm_scale,
        v_scale,
        PRECISION: tl.constexpr,
        GROUP: tl.constexpr,
        HEADS: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT: tl.constexpr,
    ):
        req = tl.program_id(0)
        first_head = tl.program_id(1) * HEADS  # HEADS query heads per program, all of one KV head
        kv_head = first_head // GROUP
        block = tl.program_id(2)
        q_len = tl.load(Q_LEN + req)
        if block * BLOCK_M >= q_len:
            return
        seq_len = tl.load(SEQ_LEN + req)
        q_start = tl.load(Q_START + req)
        cached = seq_len - q_len

        # tile row r: query head first_head + r // BLOCK_M, new token block * BLOCK_M + r % BLOCK_M
        offs_r = tl.arange(0, HEADS_PAD * BLOCK_M)
        h = offs_r // BLOCK_M
        offs_m = block * BLOCK_M + offs_r % BLOCK_M  # index among this request's new tokens
        offs_d = tl.arange(0, HEAD_DIM)
        r_mask = (offs_m < q_len) & (h < HEADS)
        head = first_head + h
        q = tl.load(
            Q + (q_start + offs_m)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=r_mask[:, None],
            other=0.0,
        ).to(DOT)
        q_pos = cached + offs_m

        end = tl.minimum(seq_len, cached + (block + 1) * BLOCK_M)  # causal: later keys are never seen
        m_i, l_i, acc = attend_locations(
            q,
            K,
            V,
            LOCS + req * stride_lb,
            0,
            end,
            kv_head * stride_kh,
            stride_kn,
            sm_scale,
            HEADS_PAD * BLOCK_M,
            HEAD_DIM,
            BLOCK_N,
            PRECISION,
            DOT,
            q_pos,
            True,
        )
        out = acc * v_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            O + (q_start + offs_m)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(O.dtype.element_ty),
            mask=r_mask[:, None],
        )


def prefill_tile(group: int, block_m: int, block_n: int) -> tuple[int, int, int, int]:
    """(query heads per program, new tokens per program, keys per iteration, num_warps) for the
    unified kernel.

    A power-of-two GQA group shares one tile: about `block_m` x 2 rows, at least 16 tokens; such a
    128-row tile runs best with 32-key blocks on 8 warps (the sweep: docs/attention-kernels.md).
    Other groups (SmolLM2's 3) keep one head per program: a packed tile would pad a quarter of
    its rows, and that shape was not measured."""
    if group > 1 and group & (group - 1) == 0:
        tokens = max(16, (block_m * 2) // group)
        if tokens * group >= 128:
            return group, tokens, min(block_n, 32), 8
        return group, tokens, block_n, 4
    return 1, block_m, block_n, 4


class TritonPagedBackend(AttentionBackend):
    """The CUDA backend (also runs under TRITON_INTERPRET=1 on CPU tensors, for tests).

    Pure-decode steps use the split-KV decode kernel over the request-to-token table
    (`triton_decode`); prefill, chunked extend and mixed steps use the unified kernel above.
    `plan_decode` sets device-side decode metadata directly, for CUDA-graph capture.
    """

    reads_stored_kv = True

    def __init__(
        self,
        block_m: int | None = None,
        block_n: int = 64,
        max_batch: int = 256,
        max_splits: int = 16,
        cascade: bool = False,
        prefix_splits: int = 4,
        fp8_decode: str = "cuda",
    ) -> None:
        """block_m: new tokens per program of the unified kernel without GQA (`prefill_tile` scales
        it for a query group); None picks 64 for 16-bit KV (prefill on the H200 ran much faster
        than with 16) and 16 for float32.
        cascade: decode steps read a prefix that several requests share once per group
        (`shared_prefix.py`), in `prefix_splits` splits.
        fp8_decode: over an FP8 pool, decode's stage 1 in the CUDA C++ kernel ("cuda",
        `cuda_fp8_decode.py`: about 15% faster per layer on the H200; the Triton kernel where it
        cannot run, said once in the log) or in Triton ("triton")."""
        if fp8_decode not in ("cuda", "triton"):
            raise ValueError(f"fp8_decode must be 'cuda' or 'triton', got {fp8_decode!r}")
        if triton is None:
            raise RuntimeError("the Triton attention backend needs the `triton` package")
        self.block_m, self.block_n = block_m, block_n
        self.max_batch, self.max_splits = max_batch, max_splits
        self.cascade, self.prefix_splits = cascade, prefix_splits
        self.fp8_decode = fp8_decode
        self._cuda_fp8: bool | None = None  # whether the CUDA kernel can run here (decided once)
        self._shape: tuple[int, int, int] | None = None  # (heads, kv_heads, head_dim), from configure
        self._decode: DecodePlan | None = None  # set for a pure-decode step
        self._groups: PrefixGroups | None = None  # this decode step's shared prefixes (cascade)
        self._workspace: DecodeWorkspace | None = None

    def configure(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        if self._shape != (num_heads, num_kv_heads, head_dim):
            self._shape = (num_heads, num_kv_heads, head_dim)
            self._workspace = None

    def plan(self, batch: AttentionBatch) -> None:
        device = batch.locs.device
        self._out_loc = batch.out_loc
        self._decode = None
        self._groups = None
        table, rows = batch.table, batch.rows  # from_page_table sets both
        if batch.is_decode and table is not None and rows is not None and batch.batch_size <= self.max_batch:
            seq = torch.tensor(batch.seq_lens, dtype=torch.int32).to(device)
            splits = num_splits_for(batch.batch_size, self._configured()[1], max_splits=self.max_splits)
            self.plan_decode(table, rows, seq, splits, cascade=batch.may_share)
            return
        q_lens = torch.tensor(batch.q_lens, dtype=torch.int32)
        self._q_len = q_lens.to(device)
        self._seq_len = torch.tensor(batch.seq_lens, dtype=torch.int32).to(device)
        self._q_start = (torch.cumsum(q_lens, 0) - q_lens).to(torch.int32).to(device)
        # a row stride that is always a multiple of 64: Triton compiles a variant per divisibility
        # of integer arguments, and a new one mid-run (the batch's longest row) costs a compilation
        width = -(-batch.locs.shape[1] // 64) * 64
        self._locs = torch.nn.functional.pad(batch.locs, (0, width - batch.locs.shape[1])).contiguous()
        self._max_q = max(batch.q_lens)

    def plan_decode(
        self, table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, num_splits: int, cascade: bool = True
    ) -> None:
        """Decode metadata already on the device: rows [B] int64 into table, seq_lens [B] int32.
        cascade=False: no row shares a prefix with another, so plain decode does. The CUDA graphs
        call it inside the captured step, so the grouping below is replayed with it."""
        heads, kv_heads, head_dim = self._configured()
        self._decode = DecodePlan(table, rows, seq_lens, num_splits, longest_first(seq_lens))
        prefix_splits = self.prefix_splits if self.cascade else 0
        ws = self._workspace
        if ws is None or ws.part_o.device != table.device:
            self._workspace = DecodeWorkspace(
                self.max_batch, heads, head_dim, self.max_splits, table.device, prefix_splits=prefix_splits
            )
        self._groups = None
        if self.cascade and cascade:  # once per step, for every layer
            self._groups = find_prefix_groups(table, rows, seq_lens, members_per_group(heads // kv_heads))

    def _uses_cuda_fp8(self, q: torch.Tensor, kp: torch.Tensor, token_dim: int) -> bool:
        if self.fp8_decode != "cuda" or kp.dtype != torch.float8_e4m3fn:
            return False
        if self._cuda_fp8 is None:
            why = cuda_fp8_decode.available(q.device)
            if why is None and not cuda_fp8_decode.supports(q, kp, token_dim):
                why = f"q {tuple(q.shape)} {q.dtype} over a {tuple(kp.shape)} pool is not a shape it takes"
            if why is not None:
                log.warning("FP8 decode stays in Triton: the CUDA kernel cannot run (%s)", why)
            self._cuda_fp8 = why is None
        return self._cuda_fp8

    def _configured(self) -> tuple[int, int, int]:
        if self._shape is None:
            raise RuntimeError(
                "TritonPagedBackend: call configure(num_heads, num_kv_heads, head_dim) first "
                "(CausalLM does when the backend is set)"
            )
        return self._shape

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, pool: KVPool) -> torch.Tensor:
        pool.store(layer, self._out_loc, k, v)
        return self.forward_stored(q, layer, pool)

    def forward_stored(self, q: torch.Tensor, layer: int, pool: KVPool) -> torch.Tensor:
        """Attention for q [T, heads, D] once this step's K/V are in the pool."""
        kp, vp = pool.k[layer], pool.v[layer]
        q = q.to(pool.compute_dtype)
        # an FP8 pool: the kernels read e4m3, scale the scores by K's scale and the output by V's
        k_scale, v_scale = pool.k_scale[layer], pool.v_scale[layer]
        plan = self._decode
        if plan is not None:
            assert self._workspace is not None  # plan_decode sized it
            head_dim = q.shape[2]
            kv_heads = kp.shape[1 - pool.token_dim]
            launch = triton_decode.decode_launch_config(q.shape[0], kv_heads, kp.dtype, head_dim)
            stage1 = "cuda" if self._uses_cuda_fp8(q, kp, pool.token_dim) else "triton"
            return decode_attention(
                q,
                kp,
                vp,
                pool.token_dim,
                plan.table,
                plan.rows,
                plan.seq_lens,
                self._workspace,
                plan.num_splits,
                k_scale=k_scale,
                v_scale=v_scale,
                groups=self._groups,
                prefix_launch=triton_decode.PREFIX_LAUNCH,
                order=plan.order,
                stage1=stage1,
                **launch.kernel_args(),
            )
        q = q.contiguous()
        out = torch.empty_like(q)
        heads, head_dim = q.shape[1], q.shape[2]
        token_dim = pool.token_dim
        block_m = self.block_m or (16 if q.dtype == torch.float32 else 64)
        group = heads // kp.shape[1 - token_dim]
        per_program, tokens, block_n, warps = prefill_tile(group, block_m, self.block_n)
        grid = (len(self._q_len), heads // per_program, triton.cdiv(self._max_q, tokens))
        _paged_attention_kernel[grid](
            q,
            kp,
            vp,
            out,
            self._locs,
            self._q_start,
            self._q_len,
            self._seq_len,
            q.stride(0),
            q.stride(1),
            kp.stride(token_dim),
            kp.stride(1 - token_dim),
            out.stride(0),
            out.stride(1),
            self._locs.stride(0),
            head_dim**-0.5 * k_scale,
            v_scale,
            # float32 stays float32 (Hopper would otherwise round dot inputs to TF32)
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            GROUP=group,
            HEADS=per_program,
            HEADS_PAD=triton.next_power_of_2(per_program),
            HEAD_DIM=head_dim,
            BLOCK_M=tokens,
            BLOCK_N=block_n,
            DOT=triton_decode.dot_dtype(q.dtype, kp.dtype),
            num_warps=warps,
        )
        return out
