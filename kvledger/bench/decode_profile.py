"""A profiler breakdown of the engine's decode steps: GPU kernel time by kind (attention, GEMMs,
sampling, other) and the host's `kvledger.*` ranges (schedule, complete, wait), per step."""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, List, Optional

import torch

CATEGORIES = ("attention", "gemm", "all-reduce", "sampling", "other")
HOST_RANGES = ("kvledger.schedule", "kvledger.complete", "kvledger.wait")


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


_ATTENTION = ("attention", "attn", "fp8_decode", "_fwd_kernel", "paged", "flash", "fmha", "scaled_dot_product", "sdpa")
_GEMM = (
    "gemm",
    "gemv",
    "linear_pointwise",
    "cutlass",
    "sm90",
    "nvjet",
    "cublas",
    "matmul",
    "xmma",
    "splitk",
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::linear",
    "aten::baddbmm",
)
_COLLECTIVE = ("nccl", "allreduce", "all_reduce", "allgather", "all_gather", "c10d::", "gloo")
_SAMPLING = ("argmax", "argmin", "topk", "top_k", "sort", "softmax", "multinomial", "sampl", "gumbel")


def classify_kernel(name: str) -> str:
    """attention, gemm, all-reduce (tensor parallelism's collectives), sampling or other, from a
    GPU kernel's (or on the CPU, an op's) name."""
    n = name.lower()
    if any(k in n for k in _COLLECTIVE):
        return "all-reduce"
    if any(k in n for k in _ATTENTION):
        return "attention"
    if any(k in n for k in _GEMM):
        return "gemm"
    if any(k in n for k in _SAMPLING):
        return "sampling"
    return "other"


def _union_us(intervals: List[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarize_profile(events, decode_steps: int, wall_s: float, cuda: bool) -> Dict[str, Any]:
    """Per-decode-step time by kernel kind and by host `kvledger.*` range, from profiler events."""
    from torch.autograd import DeviceType

    cats = {c: 0.0 for c in CATEGORIES}
    kernels: List[tuple[float, float]] = []
    host: Dict[str, float] = {}
    host_intervals: List[tuple[float, float]] = []
    top: Dict[str, float] = {}
    calls: Dict[str, int] = {}
    for e in events:
        name = e.name
        is_annotation = bool(getattr(e, "is_user_annotation", False))
        if e.device_type == DeviceType.CPU and name.startswith("kvledger."):
            host[name] = host.get(name, 0.0) + e.time_range.elapsed_us()
            host_intervals.append((e.time_range.start, e.time_range.end))
            continue
        if is_annotation or name.startswith("ProfilerStep"):
            continue
        if cuda:
            if e.device_type != DeviceType.CUDA:
                continue
            dur = e.time_range.elapsed_us()
            kernels.append((e.time_range.start, e.time_range.end))
        else:
            if e.device_type != DeviceType.CPU or getattr(e, "is_python_function", False):
                continue
            dur = e.self_cpu_time_total
        cats[classify_kernel(name)] += dur
        top[name] = top.get(name, 0.0) + dur
        calls[name] = calls.get(name, 0) + 1
    steps = max(decode_steps, 1)
    kernel_total = sum(cats.values())
    wall_ms = wall_s * 1e3 / steps
    per = lambda us: us / 1e3 / steps  # noqa: E731
    return {
        "decode_steps": decode_steps,
        "device_activity": "cuda kernels" if cuda else "cpu ops (self time; CUDA activity unavailable)",
        "wall_ms_per_step": wall_ms,
        "categories": {
            c: {"ms_per_step": per(us), "percent": 100.0 * us / kernel_total if kernel_total else 0.0}
            for c, us in cats.items()
        },
        "device_total_ms_per_step": per(kernel_total),
        "device_busy_ms_per_step": per(_union_us(kernels)) if cuda else None,
        "host_ranges": {
            n: {"ms_per_step": per(us), "percent_of_wall": 100.0 * per(us) / wall_ms if wall_ms else 0.0}
            for n, us in sorted(host.items())
        },
        "host_total_ms_per_step": per(_union_us(host_intervals)),
        "launches_per_step": sum(calls.values()) / steps,
        "top_kernels": [
            {"name": n, "ms_per_step": per(us), "category": classify_kernel(n), "launches_per_step": calls[n] / steps}
            for n, us in sorted(top.items(), key=lambda kv: -kv[1])[:15]
        ],
    }


def profile_decode(llm, prompts: List[List[int]], max_tokens: List[int], device: str) -> Dict[str, Any]:
    """Profile the decode steps of one batch: the profiler starts once every request has its first
    token (prefill done), by wrapping the engine's step; falls back to the whole generate."""
    from torch.profiler import ProfilerActivity, profile

    from kvledger.fast import SamplingParams

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m) for m in max_tokens]
    prof = profile(activities=activities)
    state: Dict[str, Any] = {"seen": set(), "started": False, "steps": 0, "t0": 0.0}
    engine: Any = getattr(llm, "engine", None)
    step: Optional[Callable[[], List[Any]]] = getattr(engine, "step", None)

    def profiled(step: Callable[[], List[Any]]) -> Callable[[], List[Any]]:
        def profiled_step() -> List[Any]:
            if not state["started"] and len(state["seen"]) >= len(prompts):
                sync(device)
                prof.start()
                state["started"], state["t0"] = True, time.perf_counter()
            events = step()
            if state["started"]:
                state["steps"] += 1
            else:
                state["seen"].update(ev.uid for ev in events)
            return events

        return profiled_step

    scope = "decode steps only"
    if step is not None:
        engine.step = profiled(step)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        if step is not None:
            del engine.step  # back to the class's method
        wall = 0.0
        if state["started"]:
            sync(device)
            wall = time.perf_counter() - state["t0"]
            prof.stop()
    steps = state["steps"]
    if not state["started"] or steps == 0:  # generate no longer goes through engine.step
        scope = "whole generate (prefill included)"
        with profile(activities=activities) as prof:
            sync(device)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            sync(device)
            wall = time.perf_counter() - t0
        steps = max(max_tokens)
    for o in outs:
        if o.error is not None:
            raise o.error
    summary = summarize_profile(prof.events(), steps, wall, cuda)
    summary.update(
        {
            "scope": scope,
            "requests": len(prompts),
            "prompt_tokens": sum(len(p) for p in prompts),
            "max_tokens": max(max_tokens),
        }
    )
    return summary


def format_breakdown(b: Dict[str, Any], top: int = 12) -> List[str]:
    lines = [
        f"decode profile (kvledger): {b['requests']} requests, {b['decode_steps']} steps profiled "
        f"({b['scope']}); {b['device_activity']}",
        f"  {'kind':<22} {'ms/step':>9} {'%':>7}",
    ]
    for c in CATEGORIES:
        d = b["categories"][c]
        lines.append(f"  {c:<22} {d['ms_per_step']:>9.3f} {d['percent']:>6.1f}%")
    lines.append(f"  {'total':<22} {b['device_total_ms_per_step']:>9.3f}")
    if b.get("launches_per_step") is not None:
        lines.append(f"  {b['launches_per_step']:.0f} kernels (or ops) per step")
    wall = b["wall_ms_per_step"]
    if b.get("device_busy_ms_per_step") is not None:
        busy = b["device_busy_ms_per_step"]
        lines.append(
            f"  GPU busy {busy:.3f} ms of {wall:.3f} ms wall per step "
            f"({100 * busy / wall if wall else 0:.1f}%; wall includes profiler overhead)"
        )
    else:
        lines.append(f"  wall {wall:.3f} ms per step (profiler overhead included)")
    lines.append(f"  {'host range':<22} {'ms/step':>9} {'% wall':>7}")
    names = list(HOST_RANGES) + [n for n in b["host_ranges"] if n not in HOST_RANGES]
    for n in names:
        d = b["host_ranges"].get(n)
        if d is None:
            lines.append(f"  {n:<22} {'n/a':>9} {'n/a':>7}")
        else:
            lines.append(f"  {n:<22} {d['ms_per_step']:>9.3f} {d['percent_of_wall']:>6.1f}%")
    tot = b["host_total_ms_per_step"]
    lines.append(f"  {'kvledger.* (union)':<22} {tot:>9.3f} {100 * tot / wall if wall else 0:>6.1f}%")
    if b["device_activity"].startswith("cuda") and not b["device_total_ms_per_step"]:
        lines.append(
            "  no GPU kernels were recorded (kernels replayed from CUDA graphs untraced?): try --no-cuda-graphs"
        )
    lines.append("  top kernels (ops on the CPU), ms/step, launches/step and kind:")
    for k in b["top_kernels"][:top]:
        n = k.get("launches_per_step", float("nan"))
        lines.append(f"    {k['ms_per_step']:>9.3f} {n:>5.0f}  {k['category']:<9}  {_shorten(k['name'])}")
    return lines


def _shorten(name: str, width: int = 100) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


# ------------------------------------------------------------------------------------ driver
