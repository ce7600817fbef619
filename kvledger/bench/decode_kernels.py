"""Decode-kernel sweeps on a CUDA device: `python -m kvledger.bench.decode_kernels`.

Prints microseconds per layer (Qwen3-0.6B's attention shape: 16 query heads, 8 KV heads, head
dim 128, 16-token pages on scattered pages, a head-major pool as the engine keeps it):

- `plain`: the split-KV decode kernel at the nano-vllm decode shape (batch 256, 600-token
  contexts), bf16 and FP8 caches, over BLOCK_N x num_warps x num_stages;
- `cascade`: the shared-prefix bench's decode shape (32 groups x 8 requests, a 2,048-token shared
  prefix, 272 tokens of their own): flat decode, the whole cascade path, and the prefix kernel
  alone over prefix splits x BLOCK_N x num_warps x num_stages;
- `order`: batches of mixed lengths (and one of equal lengths, the control), bf16 and FP8
  caches: batch order against longest-first order (`longest_first`), over launches and split
  counts; outputs are compared with the first launch's;
- `blocks`: every block of keys bounds-masked or only the last partial one (`mask_tail_only`),
  with 64- or 32-bit token offsets (`narrow`), per launch, bf16 and FP8 at three Qwen3 shapes and
  bf16 at SmolLM2-135M's (9 query heads, 3 KV heads, head dim 64), longest-first order;
- `fa3`: kvledger's decode kernels (bf16 and FP8, launched as the engine launches them) side by
  side with FlashAttention-3's paged decode on the same token-major pool, at four batch shapes.
  FA3 is a benchmark-only peer, never a dependency: `--fa3-library` names the `_vllm_fa3_C.abi3.so`
  of a vLLM wheel (`pip download --no-deps vllm==0.26.0`, then unzip
  `vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so`), loaded with `torch.ops.load_library`. FA3's FP8
  path takes the query in e4m3 too (with per-head descales), as vLLM runs it;
- `peers`: the same with FlashInfer's paged decode as well (`kvledger.bench.flashinfer_peer`; its
  CUDA-core kernel, and with `--tensor-cores` its FA2 tensor-core kernel) and FA3 where
  `--fa3-library` is given; each timed over CUDA-graph replays, its bandwidth set against the
  device-to-device copy's. FlashInfer comes from `kvledger.bench.flashinfer_pack`'s archive.

The raw outputs: results/gpu/decode-stage-sweep.txt, results/gpu/shared-prefix/cascade-kernel-sweep.txt,
results/gpu/launch-order/decode-per-layer-order.txt, results/gpu/fp8-blocks/decode-per-layer-blocks.txt,
results/gpu/fp8-blocks/decode-fa3-side-by-side.txt and results/gpu/flashinfer/decode-peers.txt.
"""

from __future__ import annotations

import argparse
import functools
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


def timed_launch(launch, q, k, v, table, rows, seq, ws, splits, k_scale, v_scale, order) -> Tuple[torch.Tensor, float]:
    """A head-major pool's decode at one launch: its output (float32) and microseconds per call."""
    from kvledger.engine.attention.triton_decode import decode_attention

    def run():
        return decode_attention(
            q, k, v, 1, table, rows, seq, ws, splits, k_scale=k_scale, v_scale=v_scale, order=order,
            **launch.kernel_args(),
        )  # fmt: skip

    out = run().float()
    return out, time_us(run, 50)


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


ORDER_SHAPES = ((256, 100, 1500), (256, 100, 2048), (128, 500, 2048), (64, 100, 2048), (256, 600, 600))


def sweep_order(seed: int) -> None:
    from kvledger.engine.attention.triton_decode import (
        DecodeLaunch,
        DecodeWorkspace,
        decode_launch_config,
        longest_first,
        num_splits_for,
    )

    fp8 = torch.float8_e4m3fn
    g = torch.Generator().manual_seed(seed)
    for batch, low, high in ORDER_SHAPES:
        lens = torch.randint(low, high + 1, (batch,), generator=g)
        per_row = -(-high // PAGE)
        perm = torch.randperm(batch * per_row + 8)[: batch * per_row].view(batch, per_row)
        table = table_of(perm.tolist())
        q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        rows = torch.arange(batch, device="cuda")
        seq = lens.to(torch.int32).cuda()
        ws = DecodeWorkspace(batch, HEADS, HEAD_DIM, 16, "cuda")
        base = num_splits_for(batch, KV_HEADS)
        for dtype in (fp8, torch.bfloat16):
            kf, vf = (torch.randn(KV_HEADS, (batch * per_row + 8) * PAGE, HEAD_DIM, device="cuda") for _ in range(2))
            ks = float(kf.abs().max() / 448) if dtype == fp8 else 1.0
            vs = float(vf.abs().max() / 448) if dtype == fp8 else 1.0
            k, v = (kf / ks).to(dtype), (vf / vs).to(dtype)
            nbytes = int(lens.sum()) * KV_HEADS * HEAD_DIM * 2 * k.element_size()
            launches = [decode_launch_config(batch, KV_HEADS, dtype, HEAD_DIM)]
            if dtype == fp8:
                launches += [DecodeLaunch(128, 4), DecodeLaunch(32, 2, 2, 128)]
            first = None
            for launch, splits, order in itertools.product(
                launches, sorted({base, min(16, base * 2), min(16, base * 4)}), (None, longest_first(seq))
            ):
                out, us = timed_launch(launch, q, k, v, table, rows, seq, ws, splits, ks, vs, order)
                first = out if first is None else first
                diff = float((out - first).norm() / first.norm())
                print(
                    f"  {batch} x U({low},{high}) {str(dtype).split('.')[-1]:14s} {launch.block_n:3d},"
                    f"{launch.num_warps},{launch.num_stages},{launch.max_registers} splits {splits:2d} "
                    f"{'batch order  ' if order is None else 'longest-first'}: {us:7.1f} us "
                    f"{nbytes / us / 1e3:6.0f} GB/s diff {diff:.0e}"
                )


FA3_SHAPES = (
    ("256 x 600", 256, 600, None),
    ("256 x U(100,1500)", 256, 100, 1500),
    ("64 x 2000", 64, 2000, None),
    ("16 x 4000", 16, 4000, None),
)


BLOCKS_SHAPES = (  # (batch, shortest, longest, query heads, KV heads, head dim, KV dtypes)
    (256, 600, 600, HEADS, KV_HEADS, HEAD_DIM, ("float8_e4m3fn", "bfloat16")),
    (256, 100, 1500, HEADS, KV_HEADS, HEAD_DIM, ("float8_e4m3fn", "bfloat16")),
    (64, 2000, 2000, HEADS, KV_HEADS, HEAD_DIM, ("float8_e4m3fn", "bfloat16")),
    (256, 100, 1500, 9, 3, 64, ("bfloat16",)),
)


def sweep_blocks(seed: int) -> None:
    from kvledger.engine.attention.triton_decode import (
        DecodeLaunch,
        DecodeWorkspace,
        decode_launch_config,
        longest_first,
        num_splits_for,
    )

    g = torch.Generator().manual_seed(seed)
    for batch, low, high, heads, kv_heads, head_dim, dtypes in BLOCKS_SHAPES:
        lens = torch.randint(low, high + 1, (batch,), generator=g)
        per_row = -(-high // PAGE)
        tokens = (batch * per_row + 8) * PAGE
        table = table_of(torch.randperm(batch * per_row + 8)[: batch * per_row].view(batch, per_row).tolist())
        q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        rows, seq = torch.arange(batch, device="cuda"), lens.to(torch.int32).cuda()
        order, splits = longest_first(seq), num_splits_for(batch, kv_heads)
        ws = DecodeWorkspace(batch, heads, head_dim, 16, "cuda")
        for dtype in (getattr(torch, d) for d in dtypes):
            kf, vf = (torch.randn(kv_heads, tokens, head_dim, device="cuda") for _ in range(2))
            fp8 = dtype == torch.float8_e4m3fn
            ks, vs = (float(kf.abs().max() / 448), float(vf.abs().max() / 448)) if fp8 else (1.0, 1.0)
            k, v = (kf / ks).to(dtype), (vf / vs).to(dtype)
            nbytes = int(lens.sum()) * kv_heads * head_dim * 2 * k.element_size()
            engine = decode_launch_config(batch, kv_heads, dtype, head_dim)
            others = (
                [DecodeLaunch(64, 2), DecodeLaunch(64, 4)]
                if head_dim > 64
                else [DecodeLaunch(64, 4), DecodeLaunch(128, 4, 3)]
            )
            print(f"{batch} x U({low},{high}), heads {heads}/{kv_heads}, dim {head_dim}, {dtype} KV, {splits} splits")
            first = None
            for shape, masks in itertools.product([engine] + others, ((0, 0), (1, 0), (1, 1))):
                launch = DecodeLaunch(
                    shape.block_n, shape.num_warps, shape.num_stages, shape.max_registers, *map(bool, masks)
                )
                out, us = timed_launch(launch, q, k, v, table, rows, seq, ws, splits, ks, vs, order)
                first = out if first is None else first
                print(
                    f"  {launch.block_n:3d},{launch.num_warps},{launch.num_stages},{launch.max_registers} "
                    f"tail-only masks {masks[0]} narrow {masks[1]}: {us:7.1f} us {nbytes / us / 1e3:6.0f} GB/s "
                    f"diff {float((out - first).norm() / first.norm()):.0e}"
                )


def _fa3_decode(q, k_pages, v_pages, block_table, seq_lens, descales=None, cu_q=None, max_seqlen=None):
    """FA3's paged decode: q [B, heads, D] (one token per request) over pages [n, PAGE, kv_heads, D].
    The positional arguments are those of the `fwd` op of vLLM 0.26.0's _vllm_fa3_C. Under CUDA-graph
    capture, pass `cu_q` (arange(B + 1), int32) and `max_seqlen`, which otherwise cost a launch and a
    host sync."""
    batch = q.shape[0]
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device) if cu_q is None else cu_q
    max_seqlen = int(seq_lens.max()) if max_seqlen is None else max_seqlen
    q_descale, k_descale, v_descale = descales or (None, None, None)
    out, *_ = torch.ops._vllm_fa3_C.fwd(
        q, k_pages, v_pages, None, None, None, None, cu_q, None, None, None, seq_lens, 1, max_seqlen,
        block_table, None, None, None, None, None, q_descale, k_descale, v_descale, q.shape[-1] ** -0.5, True,
        -1, -1, 0.0, True, None, 0, None, 0, None, 1, 0, None,
    )  # fmt: skip
    return out


def graph_us(fn: Callable[[], object], calls: int = 20, replays: int = 10) -> float:
    """Median microseconds per call over `replays` replays of a CUDA graph of `calls` calls (after 3
    eager warm-up calls): the kernels' time without the host's launch gaps, as the engine runs them."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError as e:  # a peer that syncs with the host cannot be captured: say so, time nothing
        print(f"  (CUDA-graph capture failed: {str(e).splitlines()[0][:160]})")
        return float("nan")
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def copy_gbps(nbytes: int = 2**31) -> float:
    """Device-to-device copy bandwidth (`copy_`), bytes read plus bytes written: the ceiling a decode
    kernel's KV bytes per second is compared with."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    # eager, as the project's copy ceiling was measured: the same copy replayed in a CUDA graph (a
    # memcpy node) moved only 2,712 GB/s on the H200 (results/gpu/flashinfer/decode-peers-first-run.txt)
    return 2 * nbytes / time_us(lambda: dst.copy_(src), reps=10) / 1e3


def side_by_side(fa3_library: str | None, flashinfer: bool, tensor_cores: bool, profile: bool = False) -> None:
    """kvledger's decode kernels (the engine's launch, split count and longest-first order) against
    FlashInfer's paged decode and/or FlashAttention-3's on one token-major pool, at FA3_SHAPES.
    profile: call each peer twice (its error check and once more) and time nothing, for a profiler
    (`ncu -k regex:...`) to take one launch of each kernel at each shape."""
    from kvledger.engine.attention.triton_decode import (
        DecodeWorkspace,
        decode_attention,
        decode_launch_config,
        longest_first,
        num_splits_for,
    )

    fi = None
    if flashinfer:
        from kvledger.bench.flashinfer_peer import FlashInferDecode, import_flashinfer

        fi = import_flashinfer()
        print(f"FlashInfer {fi.__version__} from {fi.__file__}")
    if fa3_library:
        torch.ops.load_library(fa3_library)
    fp8 = torch.float8_e4m3fn
    ceiling = copy_gbps()
    print(f"device-to-device copy: {ceiling:.0f} GB/s (bytes read plus written), {torch.cuda.get_device_name()}")
    print("decode attention per layer (16 query heads, 8 KV heads, head dim 128, 16-token pages), one token-major")
    print("pool shared by all; 'graph' is the median per call over CUDA-graph replays of 20 calls, 'eager' the mean")
    print("of 30 launches; GB/s counts the KV bytes read (K and V of every context token) over the graph time;")
    print("'copy' is that over the copy bandwidth; error: relative to float32 attention over the dequantized pool")
    table_rows = []
    for label, batch, low, high in FA3_SHAPES:
        lens = [low] * batch if high is None else torch.randint(low, high + 1, (batch,)).tolist()
        pages_of = [-(-n // PAGE) for n in lens]
        perm = torch.randperm(sum(pages_of) + 8)
        rows_pages, at = [], 0
        for n in pages_of:
            rows_pages.append(perm[at : at + n].tolist() + [0] * (max(pages_of) - n))
            at += n
        block_table = torch.tensor(rows_pages, dtype=torch.int32, device="cuda")
        table = (block_table[:, :, None] * PAGE + torch.arange(PAGE, device="cuda")).flatten(1).to(torch.int32)
        seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        kf, vf = (torch.randn(len(perm) * PAGE, KV_HEADS, HEAD_DIM, device="cuda") for _ in range(2))
        ws = DecodeWorkspace(batch, HEADS, HEAD_DIM, 16, "cuda")
        splits, order = num_splits_for(batch, KV_HEADS), longest_first(seq)
        rows_b = torch.arange(batch, device="cuda")
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        for dtype in (torch.bfloat16, fp8):
            ks = float(kf.abs().max() / 448) if dtype == fp8 else 1.0
            vs = float(vf.abs().max() / 448) if dtype == fp8 else 1.0
            k, v = (kf / ks).to(dtype), (vf / vs).to(dtype)
            nbytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * k.element_size()
            launch = decode_launch_config(batch, KV_HEADS, dtype, HEAD_DIM)
            pages_k, pages_v = (x.view(-1, PAGE, KV_HEADS, HEAD_DIM) for x in (k, v))
            peers: list[tuple[str, Callable[[], torch.Tensor]]] = [
                (
                    "kvledger",
                    lambda: decode_attention(
                        q,
                        k,
                        v,
                        0,
                        table,
                        rows_b,
                        seq,
                        ws,
                        splits,
                        k_scale=ks,
                        v_scale=vs,
                        order=order,
                        **launch.kernel_args(),
                    ),  # fmt: skip
                )
            ]
            if fi is not None:
                for cores in (False, True) if tensor_cores else (False,):
                    plan = FlashInferDecode(fi, block_table, lens, HEADS, KV_HEADS, HEAD_DIM, PAGE, dtype, cores)
                    name = "FlashInfer" + (" TC" if cores else "")
                    peers.append((name, functools.partial(plan, q, pages_k, pages_v, ks, vs)))
            if fa3_library:
                descales, q_fa3 = None, q
                if dtype == fp8:  # FA3's FP8 path takes the query in e4m3 too, as vLLM runs it
                    qs = float(q.float().abs().max() / 448)
                    q_fa3 = (q.float() / qs).to(fp8)
                    descales = tuple(torch.full((batch, KV_HEADS), x, device="cuda") for x in (qs, ks, vs))
                peers.append(
                    (
                        "FA3",
                        functools.partial(
                            _fa3_decode, q_fa3, pages_k, pages_v, block_table, seq, descales, cu_q, max(lens)
                        ),
                    )
                )
            truth = _gathered_attention(q, k.float() * ks, v.float() * vs, table, lens, CHECKED_ROWS)
            base = None
            for name, fn in peers:
                got = fn().float()[:CHECKED_ROWS]
                err = float((got - truth).norm() / truth.norm())
                if profile:
                    fn()
                    torch.cuda.synchronize()
                    print(f"  {label:18s} {dtype} {name:14s} error {err:.1e} (profiled: not timed)")
                    continue
                us, eager = graph_us(fn), time_us(fn)
                base = us if base is None else base
                gbps = nbytes / us / 1e3
                dname = "bf16" if dtype == torch.bfloat16 else "fp8 e4m3"
                table_rows.append((label, dname, name, us, gbps, gbps / ceiling, err, us / base))
                print(
                    f"  {label:18s} {dname:9s} {name:14s} graph {us:7.1f} us  eager {eager:7.1f} us  "
                    f"{gbps:5.0f} GB/s  copy {gbps / ceiling:4.0%}  error {err:.1e}  x kvledger {us / base:4.2f}"
                )
    print(
        "\n| batch x context | KV | kernel | us per layer | GB/s | share of copy | relative error | time / kvledger's |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, dname, name, us, gbps, share, err, ratio in table_rows:
        print(f"| {label} | {dname} | {name} | {us:.1f} | {gbps:.0f} | {share:.0%} | {err:.1e} | {ratio:.2f} |")


CHECKED_ROWS = 16


def _gathered_attention(q, k, v, table, lens, rows: int) -> torch.Tensor:
    """float32 attention of the first `rows` requests over their gathered tokens ([tokens, kv_heads, D])."""
    outs = []
    for b in range(rows):
        locs = table[b, : lens[b]].long()
        kk = k[locs].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        vv = v[locs].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        scores = torch.einsum("hd,hnd->hn", q[b].float(), kk) * HEAD_DIM**-0.5
        outs.append(torch.einsum("hn,hnd->hd", scores.softmax(-1), vv))
    return torch.stack(outs)


SWEEPS = ("plain", "cascade", "order", "blocks", "fa3", "peers")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvledger.bench.decode_kernels", description=__doc__.splitlines()[0])
    p.add_argument(
        "sweeps", nargs="*", help="plain, cascade, order, blocks, fa3 and/or peers (default: plain and cascade)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fa3-library", default=None, metavar="SO", help="for fa3 and peers: the _vllm_fa3_C.abi3.so")
    p.add_argument("--tensor-cores", action="store_true", help="for peers: also FlashInfer's tensor-core (FA2) decode")
    p.add_argument("--profile", action="store_true", help="for peers: one untimed call of each kernel, for ncu")
    args = p.parse_args(argv)
    bad = [s for s in args.sweeps if s not in SWEEPS]
    if bad:
        p.error(f"unknown sweep {bad[0]!r}: choose plain, cascade, order, blocks, fa3 and/or peers")
    if "fa3" in args.sweeps and not args.fa3_library:
        p.error("the fa3 side by side needs --fa3-library (the _vllm_fa3_C.abi3.so of a vLLM wheel)")
    if not torch.cuda.is_available():
        print("python -m kvledger.bench.decode_kernels: needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    sweeps = args.sweeps or ["plain", "cascade"]
    if "plain" in sweeps:
        sweep_plain()
    if "cascade" in sweeps:
        sweep_cascade()
    if "order" in sweeps:
        sweep_order(args.seed)
    if "blocks" in sweeps:
        sweep_blocks(args.seed)
    if "fa3" in sweeps:
        side_by_side(args.fa3_library, flashinfer=False, tensor_cores=False)
    if "peers" in sweeps:
        side_by_side(args.fa3_library, flashinfer=True, tensor_cores=args.tensor_cores, profile=args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
