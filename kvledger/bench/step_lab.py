"""The decode step outside attention, and the FP8 decode launch, on one GPU (CUDA only):
`python -m kvledger.bench.step_lab [gemm] [fp8]`.

`gemm`: each projection of Qwen3-0.6B and SmolLM2-135M (and their LM heads) at the decode batch
sizes, against its floor (weight, input and output bytes at the measured copy bandwidth, or the
FLOPs at the measured bf16 matrix rate, whichever is longer): cuBLAS as the engine calls it
(`F.linear`), cuBLAS on a pre-transposed [K, N] weight, and the Triton GEMM of
`kvledger/bench/triton_linear.py` over a small set of tiles; for the gate/up projection also
the unfused pair (`F.linear` + `fused_ops.silu_mul`) against the gated Triton kernel. Every
candidate is checked against a float32 product first. Times are medians over CUDA-graph replays
that call each of enough copies of the weight (256 MB in all) once, so that the weights come from
DRAM as a step's 28 or 30 layers' do.

`fp8`: the engine's FP8 decode kernel at a set of launches (block, warps, stages, register cap;
whole blocks unmasked and int32 offsets, as the engine runs it) and split counts, at 256 x 600
and two mixed-length batches, against the copy bandwidth.

Each part prints as it goes; one failing does not stop the other.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import traceback
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

MODELS = ("qwen3-0.6b", "smollm2-135m")
BATCHES = (256, 128, 64)
ROTATE_BYTES = 256 << 20  # the weight copies a graph cycles through: several times the 60 MB L2

# small-M tiles: 64-row tiles (a warpgroup's wgmma M) first, narrow N for the narrow outputs
GEMM_LAUNCHES = (
    (64, 64, 64, 4, 4),
    (64, 64, 128, 4, 3),
    (64, 128, 64, 4, 4),
    (64, 32, 128, 4, 4),
    (128, 64, 64, 4, 4),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 4, 3),
    (64, 256, 64, 8, 3),
    (32, 64, 128, 4, 4),
)


def projections(name: str) -> List[Tuple[str, int, int]]:
    """(label, N, K) of one layer's projections and the LM head, as nn.Linear weights [N, K]."""
    from kvledger.engine.model.config import builtin_config

    c = builtin_config(name)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return [
        ("qkv", q + 2 * kv, c.hidden_size),
        ("o_proj", c.hidden_size, q),
        ("gate_up", 2 * c.intermediate_size, c.hidden_size),
        ("down", c.hidden_size, c.intermediate_size),
        ("lm_head", c.vocab_size, c.hidden_size),
    ]


def matmul_tflops() -> float:
    from kvledger.bench.decode_kernels import time_us

    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192**3 / time_us(lambda: a @ b, reps=10) / 1e6


def rotating(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, weights) -> Callable:
    cycle = itertools.cycle(weights)
    return lambda: fn(x, next(cycle))


def check(got: torch.Tensor, ref: torch.Tensor) -> float:
    err = float((got.float() - ref).norm() / ref.norm())
    if not err < 2e-2:  # bf16 outputs: about 3e-3; NaN fails too
        raise AssertionError(f"relative error {err:.1e}")
    return err


SPLIT_K_TILES = ((64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (64, 64, 32, 4, 4))
SPLIT_K_SPLITS = (2, 3, 4, 6, 8)


def split_k_launches(k: int) -> List:
    from kvledger.bench.triton_linear import GemmLaunch

    launches = [GemmLaunch(*t, splits=s) for t in SPLIT_K_TILES for s in SPLIT_K_SPLITS]
    return [launch for launch in launches if launch.fits(k)]


def gemm_part(models: Sequence[str], batches: Sequence[int], split_k_only: bool = False) -> None:
    from kvledger.bench.decode_kernels import copy_gbps, graph_us
    from kvledger.bench.triton_linear import GemmLaunch, gated_linear, linear
    from kvledger.engine.model import fused_ops

    gbps, tflops = copy_gbps(), matmul_tflops()
    print(f"copy {gbps:.0f} GB/s, bf16 8192^3 matmul {tflops:.0f} TFLOP/s")
    launches = [] if split_k_only else [GemmLaunch(*t) for t in GEMM_LAUNCHES]
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in models:
        for label, n, k in projections(name):
            if split_k_only and label == "lm_head":
                continue
            wbytes = n * k * 2
            copies = max(2, min(400, -(-ROTATE_BYTES // wbytes)))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5 for _ in range(copies)]
            wts = [w.t().contiguous() for w in ws] if label != "lm_head" else []
            for m in batches:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
                ref = F.linear(x.float(), ws[0].float())
                floor = max((m * k + n * k + m * n) * 2 / gbps / 1e3, 2 * m * n * k / tflops / 1e6)
                rows: List[Tuple[str, float, float]] = []

                def add(tag: str, fn: Callable, reference: torch.Tensor) -> None:
                    try:
                        err = check(fn(), reference)
                        rows.append((tag, graph_us(fn, calls=max(20, copies)), err))
                    except Exception as e:  # a launch that does not compile or is wrong: say so
                        print(f"    {tag}: failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")

                add("cublas F.linear", rotating(F.linear, x, ws), ref)
                if wts:
                    add("cublas x @ wT", rotating(torch.mm, x, wts), ref)
                for launch in launches + (split_k_launches(k) if label != "lm_head" else []):
                    add(f"triton {launch.label()}", rotating(functools.partial(_tl, linear, launch), x, ws), ref)
                if label == "gate_up":
                    gate, up = ref.chunk(2, dim=-1)
                    gated_ref = fused_ops.silu_mul(ref.to(torch.bfloat16)).float()
                    del gate, up
                    add(
                        "cublas + silu_mul",
                        rotating(lambda a, w: fused_ops.silu_mul(F.linear(a, w)), x, ws),
                        gated_ref,
                    )
                    for launch in launches:
                        add(
                            f"gated {launch.label()}",
                            rotating(functools.partial(_tl, gated_linear, launch), x, ws),
                            gated_ref,
                        )
                print(f"{name} {label} M={m} N={n} K={k}: floor {floor:.2f} us")
                base = rows[0][1] if rows else float("nan")
                for tag, us, err in sorted(rows, key=lambda r: r[1])[:8]:
                    share = f"{floor / us:5.1%} of floor"
                    print(f"    {tag:32s} {us:7.2f} us  {share}  x{base / us:4.2f} cublas  err {err:.1e}")
            del ws, wts
            torch.cuda.empty_cache()


def _tl(fn, launch, x, w):
    return fn(x, w, launch)


FP8_SHAPES = (
    ("256 x 600", 256, 600, None),
    ("256 x U(100,1500)", 256, 100, 1500),
    ("128 x U(500,2048)", 128, 500, 2048),
)
# (block_n, warps, stages, register cap); the engine's launch first
FP8_LAUNCHES = (
    (64, 2, None, 168),
    (64, 2, 2, 168),
    (64, 2, 3, 168),
    (64, 2, 4, 168),
    (64, 2, None, None),
    (64, 2, None, 128),
    (64, 2, 3, 128),
    (64, 4, None, None),
    (64, 4, 2, None),
    (64, 4, 3, None),
    (64, 4, 4, None),
    (64, 4, None, 128),
    (128, 4, None, None),
    (128, 4, 2, None),
    (128, 4, 3, None),
    (128, 4, 2, 168),
    (128, 8, None, None),
    (128, 8, 2, None),
    (32, 2, None, None),
    (32, 2, 2, 128),
    (32, 2, 3, None),
    (32, 2, 4, 128),
    (32, 4, None, None),
    (256, 8, 2, None),
)


def fp8_part(seed: int) -> None:
    from kvledger.bench.decode_kernels import _gathered_attention, copy_gbps, graph_us
    from kvledger.bench.fp8_decode_lab import HEAD_DIM, HEADS, KV_HEADS, PAGE, scattered_pool
    from kvledger.engine.attention.triton_decode import (
        DecodeLaunch,
        DecodeWorkspace,
        decode_attention,
        longest_first,
        num_splits_for,
    )

    fp8 = torch.float8_e4m3fn
    gen = torch.Generator().manual_seed(seed)
    ceiling = copy_gbps()
    print(f"device-to-device copy {ceiling:.0f} GB/s; FP8 e4m3 KV, head-major pool, longest-first order")
    for label, batch, low, high in FP8_SHAPES:
        lens = [low] * batch if high is None else torch.randint(low, high + 1, (batch,), generator=gen).tolist()
        table, tokens = scattered_pool(lens, PAGE, gen)
        table = table.cuda().contiguous()
        seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
        order, arange = longest_first(seq), torch.arange(batch, device="cuda")
        q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        kf, vf = (torch.randn(KV_HEADS, tokens, HEAD_DIM, device="cuda") for _ in range(2))
        ks, vs = float(kf.abs().max() / 448), float(vf.abs().max() / 448)
        k, v = (kf / ks).to(fp8), (vf / vs).to(fp8)
        del kf, vf
        nbytes = sum(lens) * KV_HEADS * HEAD_DIM * 2
        truth = _gathered_attention(q, k.float().transpose(0, 1) * ks, v.float().transpose(0, 1) * vs, table, lens, 16)
        ws = DecodeWorkspace(batch, HEADS, HEAD_DIM, 16, "cuda")
        engine_splits = num_splits_for(batch, KV_HEADS)
        print(f"{label}: {nbytes / 1e6:.0f} MB of e4m3 per layer; engine splits {engine_splits}")
        results = []
        for block_n, warps, stages, cap in FP8_LAUNCHES:
            launch = DecodeLaunch(block_n, warps, stages, cap, mask_tail_only=True, narrow=True)
            for splits in sorted({1, engine_splits}):
                fn = functools.partial(
                    decode_attention, q, k, v, 1, table, arange, seq, ws, splits,
                    k_scale=ks, v_scale=vs, order=order, **launch.kernel_args(),
                )  # fmt: skip
                tag = f"{block_n:3d},{warps},{stages},{cap} splits {splits}"
                try:
                    err = float((fn().float()[:16] - truth).norm() / truth.norm())
                    us = graph_us(fn)
                except Exception as e:  # a launch Triton cannot compile (resources): say so, go on
                    print(f"  {tag:28s} failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                    continue
                share = nbytes / us / 1e3 / ceiling
                results.append((us, tag))
                print(f"  {tag:28s} {us:7.1f} us {nbytes / us / 1e3:5.0f} GB/s {share:4.0%} of copy  error {err:.1e}")
        best = sorted(results)[:5]
        print(f"  best at {label}: " + "; ".join(f"{t.strip()} {us:.1f} us" for us, t in best))
        del k, v
        torch.cuda.empty_cache()


def gated_launch(m: int):
    """The gated GEMM's best tile in the gemm part at SmolLM2's gate/up shape."""
    from kvledger.bench.triton_linear import GemmLaunch

    return GemmLaunch(64, 64, 64, 4, 4) if m > 128 else GemmLaunch(64, 32, 128, 4, 4)


def _gated_layer_forward(self, x, residual, step):
    """DecoderLayer.forward with the gate/up projection and SiLU product in one Triton kernel on the
    fused path (what the splits part's 'gated' variant runs)."""
    from kvledger.bench.triton_linear import gated_linear
    from kvledger.engine.model.kernels import FusedKernels

    kernels = step.kernels
    h, residual = kernels.add_norm(x, residual, self.input_norm)
    h, residual = kernels.add_norm(self.attn(h, step), residual, self.post_attn_norm)
    if kernels is FusedKernels:
        act = gated_linear(h, self.mlp.gate_up_proj.weight, gated_launch(h.shape[0]))
    else:
        act = kernels.silu_mul(self.mlp.gate_up_proj(h))
    return self.tp.all_reduce(self.mlp.down_proj(act)), residual


VARIANTS = (("engine", None, False), ("target 1024", 1024, False), ("gated mlp", None, True))


def splits_part(models: Sequence[str], rounds: int = 2, variants: Sequence = VARIANTS) -> None:
    """The nano-vllm workload end to end (no profile), in this process, in turn: the engine; the
    decode split rule with another target (patched where both the eager plan and the CUDA graphs
    look it up); the gated gate/up GEMM patched into the decoder layer."""
    from kvledger.bench.nano import NanoOptions, run_nano_bench
    from kvledger.engine.attention import triton_decode, triton_paged
    from kvledger.engine.model import model
    from kvledger.engine.runtime import cuda_graphs

    rule, forward = triton_decode.num_splits_for, model.DecoderLayer.forward
    try:
        for _ in range(rounds):
            for name in models:
                for label, target, gated in variants:
                    patched = rule if target is None else functools.partial(rule, target_programs=target)
                    triton_paged.num_splits_for = cuda_graphs.num_splits_for = patched  # type: ignore[attr-defined]
                    model.DecoderLayer.forward = _gated_layer_forward if gated else forward  # type: ignore[method-assign]
                    report = run_nano_bench(
                        NanoOptions(model_config=name, compare="none", profile_requests=0), print_fn=lambda *a: None
                    )
                    run = report["systems"][0]
                    print(f"  {name:14s} {label:14s}: {run['tok_per_s']:10,.1f} tok/s ok={report['ok']}", flush=True)
    finally:
        triton_paged.num_splits_for = cuda_graphs.num_splits_for = rule  # type: ignore[attr-defined]
        model.DecoderLayer.forward = forward  # type: ignore[method-assign]


SMOL_ATTENTION = (
    ("256 x 600", 256, 600, None),
    ("256 x U(100,1500)", 256, 100, 1500),
    ("128 x U(100,1500)", 128, 100, 1500),
)


def smol_attention_part(seed: int) -> None:
    """SmolLM2-135M's decode attention per layer (9 query heads, 3 KV heads, head dim 64, bf16, the
    engine's launch) at 1, 2 and 4 splits, the merge kernel included."""
    from kvledger.bench.decode_kernels import copy_gbps, graph_us
    from kvledger.bench.fp8_decode_lab import scattered_pool
    from kvledger.engine.attention.triton_decode import (
        DecodeWorkspace,
        decode_attention,
        decode_launch_config,
        longest_first,
        num_splits_for,
    )

    heads, kv_heads, dim, page = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(seed)
    ceiling = copy_gbps()
    print(f"device-to-device copy {ceiling:.0f} GB/s; SmolLM2-135M attention, bf16, head-major pool")
    for label, batch, low, high in SMOL_ATTENTION:
        lens = [low] * batch if high is None else torch.randint(low, high + 1, (batch,), generator=gen).tolist()
        table, tokens = scattered_pool(lens, page, gen)
        table = table.cuda().contiguous()
        seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
        order, arange = longest_first(seq), torch.arange(batch, device="cuda")
        q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(kv_heads, tokens, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ws = DecodeWorkspace(batch, heads, dim, 16, "cuda")
        launch = decode_launch_config(batch, kv_heads, torch.bfloat16, dim)
        nbytes = sum(lens) * kv_heads * dim * 2 * 2
        cells, first = [], None
        for splits in (1, 2, 4):
            fn = functools.partial(
                decode_attention, q, k, v, 1, table, arange, seq, ws, splits, order=order, **launch.kernel_args()
            )
            out = fn().float()
            first = out if first is None else first
            err = float((out - first).norm() / first.norm())
            us = graph_us(fn)
            cells.append(f"{splits}: {us:6.1f} us {nbytes / us / 1e3 / ceiling:4.0%} (vs 1 split {err:.0e})")
        print(f"  {label:18s} engine {num_splits_for(batch, kv_heads)} | " + " | ".join(cells))


PARTS = {
    "gemm": lambda a: gemm_part(a.models, a.batches),
    "splitk": lambda a: gemm_part(a.models, a.batches, split_k_only=True),
    "fp8": lambda a: fp8_part(a.seed),
    "splits": lambda a: splits_part(a.models, a.rounds, [v for v in VARIANTS if a.gated or not v[2]]),
    "smol-attention": lambda a: smol_attention_part(a.seed),
}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvledger.bench.step_lab", description=__doc__.splitlines()[0])
    p.add_argument("parts", nargs="*", help=f"{', '.join(PARTS)} (default: gemm and fp8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="splits: rounds of the variants")
    p.add_argument("--no-gated", dest="gated", action="store_false", help="splits: leave out the gated variant")
    p.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    p.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=list(BATCHES))
    args = p.parse_args(argv)
    parts = args.parts or ["gemm", "fp8"]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        p.error(f"unknown part {bad[0]!r}: choose from {', '.join(PARTS)}")
    if not torch.cuda.is_available():
        print("python -m kvledger.bench.step_lab: needs a CUDA device and Triton", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    failed = 0
    for part in parts:
        print(f"## {part}", flush=True)
        try:
            PARTS[part](args)
        except Exception:  # one part's failure must not lose the others' output
            failed += 1
            traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
