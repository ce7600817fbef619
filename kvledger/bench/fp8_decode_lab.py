"""FP8 decode variants against the engine's kernel (CUDA only): `python -m kvledger.bench.fp8_decode_lab`.

The engine's FP8 decode kernel reads e4m3 at about 2.7 TB/s at batch 256 x 600 (62% of DRAM's
rate by ncu, 12 warps per multiprocessor), and an earlier lab kernel with 40% fewer instructions
per block ran no faster: the kernel waits for its loads. FlashInfer's FP8 decode (CUDA cores, 72
registers, 44% occupancy) reads at 40% of DRAM's rate, so the comparison offers no faster scheme
to copy. This lab tried to keep more bytes in flight per multiprocessor with fewer, wider
programs, one split per request (the engine's choice at batch 256), on the engine's head-major
pool:

`kv_heads_per_program` (HP): one program reads HP KV heads' tiles at each block of tokens, as one
[BLOCK_N, HP * 128] tile, against a block-diagonal query tile (query row r holds its head's
vector in its KV head's 128 columns, zeros elsewhere), so the scores of every row are its own
head's; the output row keeps its KV head's columns. Per byte read: the same tensor-core work,
half (HP=2) the table loads, softmax and loop overhead. On the H200 every HP 2 and HP 4 launch
was slower than HP 1 (134 against 114 us at 256 x 600 at best), in this lab's kernel and in the
engine's kernel extended the same way (results/gpu/flashinfer/fp8-decode-lab.txt). The first
version also tried prefetching the next block into registers with Triton's pipelining off: 1.6x
to 17x slower (results/gpu/flashinfer/fp8-decode-lab-first.txt).

`--splits`: the engine's kernel and launch at 1 to 16 splits at few, long requests, FP8 and bf16
(the lab's one-split kernel took 91.9 us at 64 x 2000 where the engine's two splits took 103.7).

Each variant is checked against float32 attention over the dequantized pool and timed over
CUDA-graph replays; the engine's launch is the first row of each shape.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass
from typing import Sequence, Tuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 8, 128, 16
ROWS = 16  # the query tile's rows: the tensor cores' smallest M

if triton is not None:

    @triton.jit
    def _block(q, K, V, loc, col_off, stride_kn, sm_scale, m_i, l_i, acc, n_mask, MASKED: tl.constexpr):
        """One block of keys, in the engine's order: K, the scores and their softmax, then V (loading V
        earlier keeps its tile live across the scores: more registers under the cap)."""
        kv = loc[:, None] * stride_kn + col_off[None, :]
        if MASKED:
            k = tl.load(K + kv, mask=n_mask[:, None], other=0.0)
        else:
            k = tl.load(K + kv)
        s = tl.dot(q, tl.trans(k.to(tl.float16))).to(tl.float32) * sm_scale
        if MASKED:
            s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(V + kv, mask=n_mask[:, None], other=0.0)
        else:
            v = tl.load(V + kv)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16)).to(tl.float32)
        return m_new, l_i, acc

    @triton.jit
    def _fp8_decode_lab_kernel(
        Q,
        K,
        V,
        TABLE,
        SEQ_LEN,
        ORDER,
        OUT,
        stride_qb,
        stride_qh,
        stride_kn,
        stride_kh,
        stride_tr,
        stride_ob,
        stride_oh,
        sm_scale,
        v_scale,
        GROUP: tl.constexpr,
        HP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        first_kv = tl.program_id(0) * HP
        b = tl.load(ORDER + tl.program_id(1))
        seq_len = tl.load(SEQ_LEN + b)
        table_row = TABLE + b.to(tl.int64) * stride_tr
        r = tl.arange(0, ROWS)
        c = tl.arange(0, HP * HEAD_DIM)
        own = (r[:, None] < HP * GROUP) & (r[:, None] // GROUP == c[None, :] // HEAD_DIM)
        head = first_kv * GROUP + r
        c_d = c % HEAD_DIM
        q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + c_d[None, :], mask=own, other=0.0)
        q = q.to(tl.float16)
        col_off = (first_kv + c // HEAD_DIM) * stride_kh + c_d
        offs = tl.arange(0, BLOCK_N)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HP * HEAD_DIM], tl.float32)
        whole = seq_len // BLOCK_N * BLOCK_N
        for n0 in range(0, whole, BLOCK_N):
            loc = tl.load(table_row + n0 + offs)
            m_i, l_i, acc = _block(q, K, V, loc, col_off, stride_kn, sm_scale, m_i, l_i, acc, offs < BLOCK_N, False)
        if whole < seq_len:
            n_mask = whole + offs < seq_len
            loc = tl.load(table_row + whole + offs, mask=n_mask, other=0)
            m_i, l_i, acc = _block(q, K, V, loc, col_off, stride_kn, sm_scale, m_i, l_i, acc, n_mask, True)
        out = acc * v_scale / l_i[:, None]
        tl.store(OUT + b * stride_ob + head[:, None] * stride_oh + c_d[None, :], out.to(OUT.dtype.element_ty), mask=own)


@dataclass(frozen=True)
class LabLaunch:
    kv_heads_per_program: int
    block_n: int
    num_warps: int
    num_stages: int | None = None
    max_registers: int | None = None

    def label(self) -> str:
        regs = f", maxnreg {self.max_registers}" if self.max_registers else ""
        return (
            f"HP {self.kv_heads_per_program} block {self.block_n} warps {self.num_warps} stages {self.num_stages}{regs}"
        )


def scattered_pool(lens: Sequence[int], page: int, gen: torch.Generator) -> Tuple[torch.Tensor, int]:
    """A page table (int32 on the CPU) for rows of `lens` tokens whose pages lie in random order over
    a pool with 8 pages to spare, and that pool's size in tokens."""
    batch, per_row = len(lens), -(-max(lens) // page)
    pages = torch.randperm(batch * per_row + 8, generator=gen)[: batch * per_row].view(batch, per_row)
    table = (pages[:, :, None] * page + torch.arange(page)).flatten(1).to(torch.int32)
    return table, (batch * per_row + 8) * page


def lab_decode(q, k, v, table, seq, order, k_scale: float, v_scale: float, launch: LabLaunch) -> torch.Tensor:
    """q [B, heads, D] bf16 over a head-major FP8 pool [kv_heads, tokens, D]; one split."""
    batch, heads, head_dim = q.shape
    kv_heads = k.shape[0]
    out = torch.empty_like(q)
    options = {"num_warps": launch.num_warps}
    if launch.num_stages is not None:
        options["num_stages"] = launch.num_stages
    if launch.max_registers is not None:
        options["maxnreg"] = launch.max_registers
    hp = launch.kv_heads_per_program
    _fp8_decode_lab_kernel[(kv_heads // hp, batch)](
        q, k, v, table, seq, order, out,
        q.stride(0), q.stride(1), k.stride(1), k.stride(0), table.stride(0), out.stride(0), out.stride(1),
        head_dim**-0.5 * k_scale, v_scale,
        GROUP=heads // kv_heads, HP=hp, HEAD_DIM=head_dim, BLOCK_N=launch.block_n, ROWS=ROWS, **options,
    )  # fmt: skip
    return out


LAUNCHES = [
    LabLaunch(1, 64, 2, None, 168),  # the engine's launch, in this lab's kernel
    LabLaunch(2, 64, 2, None, 168),
    LabLaunch(2, 64, 4),
    LabLaunch(2, 64, 4, None, 128),
    LabLaunch(2, 64, 4, 4),
    LabLaunch(2, 32, 4),
    LabLaunch(2, 128, 8),
    LabLaunch(4, 64, 8),
]
SHAPES = (("256 x 600", 256, 600, None), ("256 x U(100,1500)", 256, 100, 1500), ("64 x 2000", 64, 2000, None))


@dataclass
class Case:
    """One shape's random FP8 pool, its query and the float32 truth of its first TRUTH_ROWS rows."""

    label: str
    lens: list
    table: torch.Tensor
    seq: torch.Tensor
    order: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_scale: float
    v_scale: float
    truth: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(self.lens) * KV_HEADS * HEAD_DIM * 2

    def error(self, out: torch.Tensor) -> float:
        got = out.float()[:TRUTH_ROWS]
        return float((got - self.truth).norm() / self.truth.norm())


TRUTH_ROWS = 16


def make_case(label: str, batch: int, low: int, high: int | None, g: torch.Generator) -> Case:
    from kvledger.bench.decode_kernels import _gathered_attention
    from kvledger.engine.attention.triton_decode import longest_first

    fp8 = torch.float8_e4m3fn
    lens = [low] * batch if high is None else torch.randint(low, high + 1, (batch,), generator=g).tolist()
    table, tokens = scattered_pool(lens, PAGE, g)
    table = table.cuda().contiguous()
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kf, vf = (torch.randn(KV_HEADS, tokens, HEAD_DIM, device="cuda") for _ in range(2))
    ks, vs = float(kf.abs().max() / 448), float(vf.abs().max() / 448)
    k, v = (kf / ks).to(fp8), (vf / vs).to(fp8)
    truth = _gathered_attention(
        q, k.float().transpose(0, 1) * ks, v.float().transpose(0, 1) * vs, table, lens, TRUTH_ROWS
    )
    return Case(label, lens, table, seq, longest_first(seq), q, k, v, ks, vs, truth)


def report(case: Case, name: str, fn, ceiling: float) -> None:
    from kvledger.bench.decode_kernels import graph_us

    try:
        err = case.error(fn())
    except Exception as e:  # a launch that cannot compile (resources): say so, go on
        print(f"  {name:52s} failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
        return
    us = graph_us(fn)
    gbps = case.nbytes / us / 1e3
    print(f"  {name:52s} {us:7.1f} us {gbps:5.0f} GB/s copy {gbps / ceiling:4.0%} error {err:.1e}")


def engine_variant(case: Case, stage1: str = "triton"):
    """The engine's launch and split count, stage 1 in Triton or the CUDA kernel."""
    from kvledger.engine.attention.triton_decode import (
        DecodeWorkspace,
        decode_attention,
        decode_launch_config,
        num_splits_for,
    )

    batch = len(case.lens)
    ws = DecodeWorkspace(batch, HEADS, HEAD_DIM, 16, "cuda")
    launch = decode_launch_config(batch, KV_HEADS, case.k.dtype, HEAD_DIM)
    rows = torch.arange(batch, device="cuda")
    splits = num_splits_for(batch, KV_HEADS)
    fn = functools.partial(
        decode_attention, case.q, case.k, case.v, 1, case.table, rows, case.seq, ws, splits,
        k_scale=case.k_scale, v_scale=case.v_scale, order=case.order, stage1=stage1, **launch.kernel_args(),
    )  # fmt: skip
    return f"engine, {stage1} stage 1, {splits} split(s)", fn


def run_lab(seed: int) -> None:
    from kvledger.bench.decode_kernels import copy_gbps

    g = torch.Generator().manual_seed(seed)
    ceiling = copy_gbps()
    print(f"device-to-device copy {ceiling:.0f} GB/s; FP8 e4m3 KV, head-major pool, one split, longest-first order")
    for label, batch, low, high in SHAPES:
        case = make_case(label, batch, low, high, g)
        variants: list = [engine_variant(case)]
        for lab in LAUNCHES:
            fn = functools.partial(
                lab_decode, case.q, case.k, case.v, case.table, case.seq, case.order, case.k_scale, case.v_scale, lab
            )
            variants.append((lab.label(), fn))
        print(f"{label}: {case.nbytes / 1e6:.0f} MB of e4m3 per layer")
        for name, fn in variants:
            report(case, name, fn, ceiling)


def cuda_launches():
    from kvledger.engine.attention.cuda_fp8_decode import CudaDecodeLaunch as L

    return [
        L(4, 64, 3),
        L(4, 64, 2),
        L(4, 64, 4),
        L(4, 32, 6),
        L(8, 64, 3),
        L(2, 32, 4),
        L(4, 64, 3, loads_only=True),
    ]


CUDA_SHAPES = SHAPES + (("128 x U(500,2048)", 128, 500, 2048), ("16 x 4000", 16, 4000, None))


def run_cuda(seed: int, profile: bool = False) -> None:
    """The engine's Triton and CUDA C++ stage 1 (`engine/attention/cuda_fp8_decode.cu`) inside
    `decode_attention` at the engine's split count, then the CUDA kernel at several launches with
    one split, and its copies without the arithmetic (the access pattern's bandwidth).
    profile: at the first shape only, call the Triton and the CUDA stage 1 twice each, untimed
    (for `ncu -k regex:decode`)."""
    from kvledger.bench.decode_kernels import copy_gbps
    from kvledger.engine.attention import cuda_fp8_decode as cuda

    why = cuda.available()
    if why is not None:
        print(f"the CUDA decode kernel cannot run here: {why}")
        return
    g = torch.Generator().manual_seed(seed)
    ceiling = copy_gbps()
    print(f"device-to-device copy {ceiling:.0f} GB/s; FP8 e4m3 KV, head-major pool of {PAGE}-token pages")
    for label, batch, low, high in CUDA_SHAPES[:1] if profile else CUDA_SHAPES:
        case = make_case(label, batch, low, high, g)
        if profile:
            for stage1 in ("triton", "cuda"):
                for _ in range(2):
                    engine_variant(case, stage1)[1]()
            torch.cuda.synchronize()
            return
        print(f"{label}: {case.nbytes / 1e6:.0f} MB of e4m3 per layer")
        for stage1 in ("triton", "cuda"):
            name, fn = engine_variant(case, stage1)
            report(case, name, fn, ceiling)
        rows = torch.arange(batch, device="cuda")
        part_o = torch.empty(batch, HEADS, 1, HEAD_DIM, device="cuda")
        part_lse = torch.empty(batch, HEADS, 1, device="cuda")
        for launch in cuda_launches():
            out = torch.empty_like(case.q)

            def fn(launch=launch, out=out):
                cuda.fp8_decode_split(
                    case.q, case.k, case.v, case.table, rows, case.seq, part_o, part_lse, out, 1,
                    HEAD_DIM**-0.5 * case.k_scale, case.v_scale, case.order, launch,
                )  # fmt: skip
                return out

            report(case, launch.label(), fn, ceiling)


SPLIT_SHAPES = ((64, 2000, None), (64, 100, 2048), (128, 500, 2048), (32, 500, 2048), (16, 4000, None))


def sweep_splits(seed: int) -> None:
    """The engine's kernel and launch at every split count, FP8 and bf16, at few and long requests
    (`num_splits_for` aims at 1,024 programs; the lab's one-split kernel beat two splits at 64 x 2000)."""
    from kvledger.bench.decode_kernels import graph_us
    from kvledger.engine.attention.triton_decode import (
        DecodeWorkspace,
        decode_attention,
        decode_launch_config,
        longest_first,
        num_splits_for,
    )

    g = torch.Generator().manual_seed(seed)
    for batch, low, high in SPLIT_SHAPES:
        lens = [low] * batch if high is None else torch.randint(low, high + 1, (batch,), generator=g).tolist()
        table, tokens = scattered_pool(lens, PAGE, g)
        table = table.cuda().contiguous()
        seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
        order, arange = longest_first(seq), torch.arange(batch, device="cuda")
        q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        ws = DecodeWorkspace(batch, HEADS, HEAD_DIM, 16, "cuda")
        for dtype in (torch.float8_e4m3fn, torch.bfloat16):
            k, v = (torch.randn(KV_HEADS, tokens, HEAD_DIM, device="cuda").to(dtype) for _ in range(2))
            launch = decode_launch_config(batch, KV_HEADS, dtype, HEAD_DIM)
            nbytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * k.element_size()
            first, cells = None, []
            for splits in (1, 2, 4, 8, 16):
                out = decode_attention(
                    q, k, v, 1, table, arange, seq, ws, splits, order=order, **launch.kernel_args()
                )  # fmt: skip
                first = out.float() if first is None else first
                assert float((out.float() - first).norm() / first.norm()) < 1e-2
                us = graph_us(
                    functools.partial(
                        decode_attention, q, k, v, 1, table, arange, seq, ws, splits,
                        order=order, **launch.kernel_args(),
                    )
                )  # fmt: skip
                cells.append(f"{splits}: {us:6.1f} us {nbytes / us / 1e3:5.0f} GB/s")
            shape = f"{batch} x {low}" if high is None else f"{batch} x U({low},{high})"
            engine = num_splits_for(batch, KV_HEADS)
            print(f"  {shape:18s} {str(dtype).split('.')[-1]:14s} engine {engine:2d} | " + " | ".join(cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvledger.bench.fp8_decode_lab", description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--splits", action="store_true", help="the split-count sweep instead of the variants")
    p.add_argument("--cuda", action="store_true", help="the CUDA C++ stage 1 at several launches")
    p.add_argument("--profile", action="store_true", help="with --cuda: untimed calls for a profiler")
    args = p.parse_args(argv)
    if triton is None or not torch.cuda.is_available():
        print("python -m kvledger.bench.fp8_decode_lab: needs a CUDA device and Triton", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    if args.splits:
        sweep_splits(args.seed)
    elif args.cuda:
        run_cuda(args.seed, args.profile)
    else:
        run_lab(args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
