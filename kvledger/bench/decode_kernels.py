"""Decode-kernel sweeps on a CUDA device: `python -m kvledger.bench.decode_kernels`.

Prints microseconds per layer (Qwen3-0.6B's attention shape: 16 query heads, 8 KV heads, head
dim 128, 16-token pages on scattered pages, a head-major pool as the engine keeps it):

- `plain`: the split-KV decode kernel at the nano-vllm decode shape (batch 256, 600-token
  contexts), bf16 and FP8 caches, over BLOCK_N x num_warps x num_stages;
- `cascade`: the shared-prefix bench's decode shape (32 groups x 8 requests, a 2,048-token shared
  prefix, 272 tokens of their own): flat decode, the whole cascade path, and the prefix kernel
  alone over prefix splits x BLOCK_N x num_warps x num_stages.

The results of this stop are in results/gpu/decode-stage-sweep.txt and
results/gpu/shared-prefix/cascade-kernel-sweep.txt.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Callable, Tuple

import torch

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 8, 128, 16


def time_us(fn: Callable[[], object], reps: int = 30) -> float:
    """Mean microseconds per call over `reps` calls after 3 warm-up calls (CUDA events)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1000


def head_major_pool(tokens: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    k, v = (torch.randn(KV_HEADS, tokens, HEAD_DIM, device="cuda").to(dtype) for _ in range(2))
    return k, v


def table_of(page_lists) -> torch.Tensor:
    """Token locations of each row's pages: [rows, pages * PAGE] int32."""
    pages = torch.tensor(page_lists)
    return (pages[:, :, None] * PAGE + torch.arange(PAGE)).flatten(1).to(torch.int32).cuda().contiguous()


def sweep_plain(batch: int = 256, context: int = 600) -> None:
    from kvledger.engine.attention.triton_decode import DecodeWorkspace, decode_attention

    per_row = -(-context // PAGE)
    perm = torch.randperm(batch * per_row + 8)[: batch * per_row].view(batch, per_row)
    table = table_of(perm.tolist())[:, :context].contiguous()
    rows = torch.arange(batch, device="cuda")
    seq = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    ws = DecodeWorkspace(batch, HEADS, HEAD_DIM, 16, "cuda")
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        k, v = head_major_pool((batch * per_row + 8) * PAGE, dtype)
        nbytes = batch * context * KV_HEADS * HEAD_DIM * 2 * k.element_size()
        print(f"plain decode, {dtype} KV: {nbytes / 1e6:.0f} MB per layer")
        for block_n, warps, stages in itertools.product((16, 32, 64), (2, 4), (1, 2, 3, 4)):
            us = time_us(
                lambda: decode_attention(
                    q, k, v, 1, table, rows, seq, ws, 1, block_n=block_n, num_warps=warps, num_stages=stages
                )
            )
            print(f"  block {block_n:3d} warps {warps} stages {stages}: {us:7.1f} us  {nbytes / us / 1e3:6.0f} GB/s")


def sweep_cascade(groups: int = 32, per_group: int = 8, prefix: int = 2048, own: int = 272) -> None:
    from kvledger.engine.attention.shared_prefix import find_prefix_groups, members_per_group, shared_prefix_partials
    from kvledger.engine.attention.triton_decode import DecodeWorkspace, decode_attention, dot_dtype

    batch = groups * per_group
    own_pages, prefix_pages = -(-own // PAGE), prefix // PAGE
    total = groups * prefix_pages + batch * own_pages + 8
    free = iter(torch.randperm(total).tolist())
    rows_pages = []
    for _ in range(groups):
        shared = [next(free) for _ in range(prefix_pages)]
        rows_pages += [shared + [next(free) for _ in range(own_pages)] for _ in range(per_group)]
    table = table_of(rows_pages)[torch.randperm(batch).cuda()].contiguous()  # groups spread over the batch
    rows = torch.arange(batch, device="cuda")
    seq = torch.full((batch,), prefix + own, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = head_major_pool(total * PAGE, torch.bfloat16)
    groups_found = find_prefix_groups(table, rows, seq, members_per_group(HEADS // KV_HEADS))
    flat_ws = DecodeWorkspace(batch, HEADS, HEAD_DIM, 16, "cuda")
    flat = time_us(lambda: decode_attention(q, k, v, 1, table, rows, seq, flat_ws, 1))
    reference = decode_attention(q, k, v, 1, table, rows, seq, flat_ws, 1).float()
    prefix_bytes = groups * prefix * KV_HEADS * HEAD_DIM * 4
    print(
        f"cascade shape: {groups} groups x {per_group}, {prefix}-token prefix, {own} own tokens; flat decode "
        f"{flat:.1f} us per layer; the prefix kernel reads {prefix_bytes / 1e6:.0f} MB per layer"
    )
    for splits in (2, 4, 8):
        ws = DecodeWorkspace(batch, HEADS, HEAD_DIM, 16, "cuda", prefix_splits=splits)
        out = decode_attention(q, k, v, 1, table, rows, seq, ws, 1, groups=groups_found).float()
        err = float((out - reference).norm() / reference.norm())
        whole = time_us(lambda: decode_attention(q, k, v, 1, table, rows, seq, ws, 1, groups=groups_found))
        print(
            f"  {splits} prefix splits: whole cascade {whole:.1f} us per layer (relative difference from flat "
            f"{err:.1e})"
        )
        for block_n, warps, stages in itertools.product((16, 32, 64), (2, 4), (1, 2, 3)):
            us = time_us(
                lambda: shared_prefix_partials(
                    q,
                    k,
                    v,
                    1,
                    table,
                    rows,
                    groups_found,
                    ws.part_o,
                    ws.part_lse,
                    1,
                    splits,
                    HEAD_DIM**-0.5,
                    1.0,
                    dot_dtype(q.dtype, k.dtype),
                    block_n=block_n,
                    num_warps=warps,
                    num_stages=stages,
                )
            )
            print(
                f"    prefix kernel block {block_n:3d} warps {warps} stages {stages}: {us:7.1f} us  "
                f"{prefix_bytes / us / 1e3:6.0f} GB/s"
            )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvledger.bench.decode_kernels", description=__doc__.splitlines()[0])
    p.add_argument("sweeps", nargs="*", help="plain and/or cascade (default: both)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    bad = [s for s in args.sweeps if s not in ("plain", "cascade")]
    if bad:
        p.error(f"unknown sweep {bad[0]!r}: choose plain and/or cascade")
    if not torch.cuda.is_available():
        print("python -m kvledger.bench.decode_kernels: needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    sweeps = args.sweeps or ["plain", "cascade"]
    if "plain" in sweeps:
        sweep_plain()
    if "cascade" in sweeps:
        sweep_cascade()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
