"""Split-KV decode attention over the page table, in two Triton kernels (CUDA-graph safe).

Stage 1: one program per (request, KV head, split) walks its slice of the request's token
locations straight from the request-to-token table (no gathered copy), with every query head of
that KV head's group at once (GQA: the group shares each loaded K/V block), and writes a partial
output normalized by its own softmax sum plus the log-sum-exp. Stage 2: one program per (request,
query head) merges the splits. Splitting keeps the GPU busy when few requests have long contexts;
with one split (large batches) stage 1 writes the output itself and stage 2 is skipped.

Everything the kernels need is on the device (table rows, sequence lengths), so a captured graph
replays them with new metadata copied into the same buffers; no host value enters the launch
except the batch size and the split count, which are fixed per captured graph.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kvledger.engine.attention import cuda_fp8_decode
from kvledger.engine.attention.shared_prefix import PrefixGroups, shared_prefix_partials

try:
    import triton
    import triton.language as tl

    from kvledger.engine.attention.triton_online_softmax import attend_locations, finish_partial
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _decode_attention_split_kernel(
        Q,
        K,
        V,
        TABLE,
        ROWS,
        SEQ_LEN,
        ORDER,
        START,
        PART_O,
        PART_LSE,
        O,
        stride_qb,
        stride_qh,
        stride_kn,
        stride_kh,
        stride_tr,
        stride_pb,
        stride_ph,
        stride_ps,
        stride_lb,
        stride_lh,
        stride_ob,
        stride_oh,
        sm_scale,
        v_scale,
        PRECISION: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        DOT: tl.constexpr,
        PREFIX_SPLITS: tl.constexpr,
        ORDERED: tl.constexpr,
        MASK_TAIL_ONLY: tl.constexpr,
        NARROW: tl.constexpr,
    ):
        # the grid runs KV heads fastest, then requests in ORDER (longest first): the programs that
        # take longest start in the first wave instead of trailing the launch (longest-processing-
        # time-first scheduling)
        kv_head = tl.program_id(0)
        b = tl.program_id(1)
        if ORDERED:
            b = tl.load(ORDER + b)
        split = tl.program_id(2)
        seq_len = tl.load(SEQ_LEN + b)
        row = tl.load(ROWS + b).to(tl.int64)
        offs_g = tl.arange(0, GROUP_PAD)
        g_mask = offs_g < GROUP
        heads = kv_head * GROUP + offs_g
        first = 0
        if PREFIX_SPLITS > 0:  # cascade: a grouped row's prefix [0, START[b]) is the prefix kernel's
            first = tl.load(START + b)
            if (split == 0) & (first == 0):  # in no group: its prefix slots stay empty
                offs_p = NUM_SPLITS + tl.arange(0, PREFIX_SPLITS)
                tl.store(
                    PART_LSE + b * stride_lb + heads[:, None] * stride_lh + offs_p[None, :],
                    tl.full([GROUP_PAD, PREFIX_SPLITS], float("-inf"), tl.float32),
                    mask=g_mask[:, None],
                )
        per_split = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = first + split * per_split
        end = tl.minimum(start + per_split, seq_len)

        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None], other=0.0
        ).to(DOT)

        m_i, l_i, acc = attend_locations(
            q,
            K,
            V,
            TABLE + row * stride_tr,
            start,
            end,
            kv_head * stride_kh,
            stride_kn,
            sm_scale,
            GROUP_PAD,
            HEAD_DIM,
            BLOCK_N,
            PRECISION,
            DOT,
            MASK_TAIL_ONLY=MASK_TAIL_ONLY,
            NARROW=NARROW,
        )
        out, lse = finish_partial(m_i, l_i, acc, v_scale)  # a split past a short request's end is empty
        if NUM_SPLITS + PREFIX_SPLITS == 1:  # the only partial is the answer: no merge
            tl.store(
                O + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                out.to(O.dtype.element_ty),
                mask=g_mask[:, None],
            )
        else:
            base = b * stride_pb + heads * stride_ph + split * stride_ps
            tl.store(PART_O + base[:, None] + offs_d[None, :], out, mask=g_mask[:, None])
            tl.store(PART_LSE + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)

    @triton.jit
    def _decode_attention_merge_kernel(
        PART_O,
        PART_LSE,
        O,
        stride_pb,
        stride_ph,
        stride_ps,
        stride_lb,
        stride_lh,
        stride_ob,
        stride_oh,
        HEAD_DIM: tl.constexpr,
        NUM_SLOTS: tl.constexpr,
        SLOTS_PAD: tl.constexpr,
    ):
        b = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, SLOTS_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        lse = tl.load(
            PART_LSE + b * stride_lb + head * stride_lh + offs_s, mask=offs_s < NUM_SLOTS, other=float("-inf")
        )
        weight = tl.exp(lse - tl.max(lse, 0))  # split 0 is never empty: the max is finite
        weight = weight / tl.sum(weight, 0)
        # an empty slot's output is never read (an unused prefix slot holds stale values)
        part = tl.load(
            PART_O + b * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
            mask=(lse > float("-inf"))[:, None],
            other=0.0,
        )
        out = tl.sum(part * weight[:, None], 0)
        tl.store(O + b * stride_ob + head * stride_oh + offs_d, out.to(O.dtype.element_ty))


def dot_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype):
    """What the kernels' dot products take: the query's dtype, or fp16 over an FP8 cache (e4m3
    converts to fp16 in one instruction; to bf16 it goes through fp32, which made the kernel
    compute-bound)."""
    if kv_dtype == torch.float8_e4m3fn:
        return tl.float16
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[q_dtype]


def longest_first(seq_lens: torch.Tensor) -> torch.Tensor:
    """The batch's indices by descending sequence length, on the device (CUDA-graph safe): the
    decode kernel starts the longest requests' programs first, so that none of them is left
    running alone at the end of the launch."""
    return torch.argsort(seq_lens, descending=True).to(torch.int32)


def narrow_offsets(cache: torch.Tensor) -> bool:
    """Whether every element offset into one layer's cache fits in int32: the kernels then
    compute token offsets in 32 bits (fewer registers per block of keys)."""
    return cache.numel() < 2**31


def num_splits_for(batch_size: int, kv_heads: int, target_programs: int = 768, max_splits: int = 16) -> int:
    """Enough splits that stage 1 has about `target_programs` programs (a power of two).

    768, not 1,024: SmolLM2-135M's 3 KV heads at batch 256 make 768 programs, and one split (no
    merge kernel) took 44.7 us per layer at 256 x U(100,1500) against 50.6 us at the two splits
    that 1,024 asked for; at batch 128 two splits took 28.6 us against 30.3 at four
    (results/gpu/round4/smol-attention-splits.txt). Qwen3's 8 KV heads change only between batch
    96 and 127 (one split instead of two)."""
    want = max(1, -(-target_programs // max(1, batch_size * kv_heads)))
    splits = 1
    while splits < want and splits < max_splits:
        splits *= 2
    return splits


@dataclass(frozen=True)
class DecodeLaunch:
    """How a decode kernel is launched: keys per iteration, warps, Triton's pipelining depth (None:
    its default), a cap on registers per thread (None: the compiler's choice), whether only the last
    partial block of keys is bounds-masked (the whole blocks then run without masks), and whether
    token offsets are computed in int32 where the pool allows (`narrow_offsets`)."""

    block_n: int
    num_warps: int
    num_stages: int | None = None
    max_registers: int | None = None
    mask_tail_only: bool = False
    narrow: bool = False

    def kernel_args(self) -> dict:
        """`decode_attention`'s keyword arguments for this launch (its fields, by name)."""
        return asdict(self)

    def options(self) -> dict:
        """Triton's launch options for this launch."""
        options = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            options["num_stages"] = self.num_stages
        if self.max_registers is not None:
            options["maxnreg"] = self.max_registers
        return options


def decode_launch_config(
    batch_size: int, kv_heads: int, kv_dtype: torch.dtype | None = None, head_dim: int = 128
) -> DecodeLaunch:
    """The stage-1 launch, chosen by whole-workload runs on the H200, not by per-layer sweeps
    (which favoured other shapes): 64-token blocks on 4 warps for bf16 with head dim 128, 128-token
    blocks (a 64-wide row is half the bytes) on 4 warps with 2 stages for head dim 64.

    FP8: 64-token blocks on 2 warps, at most 168 registers per thread, the whole blocks unmasked and
    int32 token offsets. Left to itself the compiler gives the FP8 kernel over 200 registers, so only
    4 programs (8 warps) fit on a multiprocessor: too few loads in flight for the memory's rate; the
    cap fits 6, and tighter caps that won in per-layer sweeps lost over the workload. Masks on the
    last block only and int32 offsets shorten the loop enough that the cap no longer spills; bf16
    gained nothing from them and head dim 64 lost (the runs: docs/attention-kernels.md)."""
    if kv_dtype == torch.float8_e4m3fn:
        return DecodeLaunch(64, 2, max_registers=168, mask_tail_only=True, narrow=True)
    if head_dim <= 64:
        return DecodeLaunch(128, 4, 2)
    return DecodeLaunch(64, 4)


# the cascade's prefix kernel: two pipeline stages, not Triton's default three, whose buffers
# halve occupancy (measured: docs/attention-kernels.md)
PREFIX_LAUNCH = DecodeLaunch(64, 4, 2)


class DecodeWorkspace:
    """Partial outputs of stage 1 for up to `max_batch` requests: allocate once, reuse per layer.
    A step with S splits uses slots [0, S) for each request's own tokens and the next
    `prefix_splits` for a shared prefix (cascade attention, `shared_prefix.py`)."""

    def __init__(
        self,
        max_batch: int,
        heads: int,
        head_dim: int,
        max_splits: int,
        device: torch.device | str,
        prefix_splits: int = 0,
    ) -> None:
        self.max_splits, self.prefix_splits = max_splits, prefix_splits
        slots = max_splits + prefix_splits
        self.part_o = torch.empty(max_batch, heads, slots, head_dim, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(max_batch, heads, slots, dtype=torch.float32, device=device)


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
    groups: PrefixGroups | None = None,
    num_stages: int | None = None,
    prefix_launch: DecodeLaunch | None = None,
    max_registers: int | None = None,
    order: torch.Tensor | None = None,
    mask_tail_only: bool = False,
    narrow: bool = False,
    stage1: str = "triton",
) -> torch.Tensor:
    """q [B, heads, D] (each request's one new token, already stored in the cache) attends over
    the request's first seq_lens[b] tokens at table[rows[b], :seq_lens[b]].

    k_cache/v_cache: one layer's pool, [tokens, kv_heads, D] (token_dim 0) or [kv_heads, tokens, D]
    (token_dim 1), in q's dtype or FP8 (e4m3, read back as value * k_scale / v_scale).
    groups: rows sharing a prefix (`find_prefix_groups`): the prefix is read once per group, in
    the workspace's prefix slots (which it must have).
    num_stages: Triton's software-pipelining depth (None: its default); max_registers: a cap on
    registers per thread (None: the compiler's choice); prefix_launch: the prefix kernel's launch
    (None: that of the decode kernel); order: the batch's indices by descending sequence length
    (`longest_first`), the order in which the programs start (None: batch order); mask_tail_only and
    narrow: as in `DecodeLaunch` (neither changes the result); stage1: "triton", or "cuda" for the
    CUDA C++ kernel over an FP8 head-major pool (`cuda_fp8_decode`: its own launch; the prefix
    kernel and the merge stay Triton's).
    Returns [B, heads, D] in q's dtype.
    """
    if triton is None:
        raise RuntimeError("decode_attention needs the `triton` package")
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1 - token_dim]
    group = heads // kv_heads
    if num_splits & (num_splits - 1) or num_splits > workspace.max_splits:
        raise ValueError(f"num_splits must be a power of two <= {workspace.max_splits}, got {num_splits}")
    prefix_splits = workspace.prefix_splits if groups is not None else 0
    if groups is not None and (not prefix_splits or prefix_splits & (prefix_splits - 1)):
        raise ValueError(
            f"shared-prefix groups need a workspace whose prefix_splits is a power of two, got {prefix_splits}"
        )
    out = torch.empty_like(q) if out is None else out
    po, pl = workspace.part_o, workspace.part_lse
    sm_scale = head_dim**-0.5 * k_scale
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    dot = dot_dtype(q.dtype, k_cache.dtype)
    if groups is not None:
        pre = prefix_launch or DecodeLaunch(block_n, num_warps, num_stages)
        shared_prefix_partials(
            q,
            k_cache,
            v_cache,
            token_dim,
            table,
            rows,
            groups,
            po,
            pl,
            num_splits,
            prefix_splits,
            sm_scale,
            v_scale,
            dot,
            block_n=pre.block_n,
            num_warps=pre.num_warps,
            num_stages=pre.num_stages,
        )
    if stage1 == "cuda":
        if not cuda_fp8_decode.supports(q, k_cache, token_dim):
            raise ValueError(
                "the CUDA decode kernel takes an FP8 head-major pool, a bf16/fp16 query, head dim 64/128/256 "
                f"and at most {cuda_fp8_decode.MAX_GROUP} query heads per KV head"
            )
        cuda_fp8_decode.fp8_decode_split(
            q, k_cache, v_cache, table, rows, seq_lens, po, pl, out, num_splits, sm_scale, v_scale, order,
            start=groups.start if groups is not None else None, prefix_splits=prefix_splits,
        )  # fmt: skip
    elif stage1 != "triton":
        raise ValueError(f"stage1 must be 'triton' or 'cuda', got {stage1!r}")
    else:
        _decode_attention_split_kernel[(kv_heads, batch, num_splits)](
            q,
            k_cache,
            v_cache,
            table,
            rows,
            seq_lens,
            order if order is not None else seq_lens,
            groups.start if groups is not None else seq_lens,
            po,
            pl,
            out,
            q.stride(0),
            q.stride(1),
            k_cache.stride(token_dim),
            k_cache.stride(1 - token_dim),
            table.stride(0),
            po.stride(0),
            po.stride(1),
            po.stride(2),
            pl.stride(0),
            pl.stride(1),
            out.stride(0),
            out.stride(1),
            sm_scale,
            v_scale,
            PRECISION=precision,
            GROUP=group,
            GROUP_PAD=max(16, triton.next_power_of_2(group)),
            HEAD_DIM=head_dim,
            BLOCK_N=block_n,
            NUM_SPLITS=num_splits,
            DOT=dot,
            PREFIX_SPLITS=prefix_splits,
            ORDERED=order is not None,
            MASK_TAIL_ONLY=mask_tail_only,
            NARROW=narrow and narrow_offsets(k_cache),
            **DecodeLaunch(block_n, num_warps, num_stages, max_registers).options(),
        )
    slots = num_splits + prefix_splits
    if slots == 1:
        return out
    _decode_attention_merge_kernel[(batch, heads)](
        po,
        pl,
        out,
        po.stride(0),
        po.stride(1),
        po.stride(2),
        pl.stride(0),
        pl.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        NUM_SLOTS=slots,
        SLOTS_PAD=triton.next_power_of_2(slots),
    )
    return out
