"""`kvledger bench --workload nano-vllm`: nano-vllm's offline throughput benchmark on this engine.

The workload is the one nano-vllm publishes (`workloads.nano_vllm`): 256 requests, exactly 142,827
input and 133,966 output tokens, greedy, EOS ignored. `--num-requests`, `--max-input-len` and
`--max-output-len` scale it down (the lower length bounds scale with the upper ones) for smoke runs
on the CPU.

It runs on this engine (random weights of a shipped config, or `--model` for real weights) and,
with `--compare transformers`, on transformers' continuous batching with the same model shape and
dtype, each request with its own `max_new_tokens`. Throughput is output tokens over wall time
(prefill included); each system first runs a few warm-up requests, outside the timing.

Besides the table it prints:

* the memory-bandwidth floor (`bench/bandwidth_floor.py`): the bytes decode must read if all
  requests decode together from the first step (every step reads the weights once, and every
  running request's KV context), over a bandwidth measured in the same run with a device-to-device
  copy;
* a profiler breakdown of decode steps (`bench/decode_profile.py`; a second, decode-heavy batch
  under torch.profiler): GPU kernel time by kind (attention, GEMM, sampling, other) and the host's
  `kvledger.*` ranges.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from kvledger.bench.bandwidth_floor import decode_floor, format_floor, measure_bandwidth, param_count
from kvledger.bench.decode_profile import format_breakdown, profile_decode
from kvledger.bench.hf import build_hf_model, run_continuous_batching
from kvledger.bench.runner import (
    DTYPES,
    ENGINE_ROW,
    BenchOptions,
    PrintFn,
    SystemRun,
    build_llm,
    device_name,
    engine_kwargs,
    format_host_line,
    free_memory,
    model_source,
    print_lines,
    resolve_model_config,
    run_workload,
    versions,
    write_report,
)
from kvledger.bench.workloads import NANO_MAX_LEN, NANO_NUM_REQUESTS, NANO_VLLM, Workload, nano_vllm, pages, warmup
from kvledger.engine.engine_config import EngineConfig


@dataclass
class NanoOptions(BenchOptions):
    num_requests: int = NANO_NUM_REQUESTS
    max_input_len: int = NANO_MAX_LEN
    max_output_len: int = NANO_MAX_LEN
    compare: str = "none"
    kv_cache_dtype: str = EngineConfig.kv_cache_dtype
    tensor_parallel_sizes: str = "1"  # comma-separated: each size runs the workload in turn
    tensor_parallel_size: int = 1  # the size being run
    hf_attn: str = "sdpa"
    hf_max_batch_tokens: Optional[int] = None
    bandwidth_bytes: Optional[int] = None  # default: 2 GiB on CUDA, 64 MiB on CPU
    bandwidth_gbs: Optional[float] = None  # use this instead of measuring
    profile_requests: int = 256
    profile_output_len: int = 32
    warmup_requests: int = 8
    # resolved
    model_config_path: Optional[Path] = None
    hf_config: Dict[str, Any] = field(default_factory=dict)

    def resolve(self) -> NanoOptions:
        self.resolve_device()
        self.bandwidth_bytes = self.bandwidth_nbytes()
        sizes = self.tp_sizes()
        if not sizes or any(n < 1 for n in sizes):
            raise ValueError(f"--tp must list sizes >= 1, comma-separated, got {self.tensor_parallel_sizes!r}")
        if self.compare not in ("none", "transformers"):
            raise ValueError(f"compare must be 'none' or 'transformers', got {self.compare!r}")
        return self

    def bandwidth_nbytes(self) -> int:
        """The bytes the bandwidth measurement copies: as given, else 2 GiB on CUDA, 64 MiB on CPU."""
        if self.bandwidth_bytes is not None:
            return self.bandwidth_bytes
        return (2 << 30) if self.cuda else (64 << 20)

    def tp_sizes(self) -> List[int]:
        try:
            return [int(x) for x in str(self.tensor_parallel_sizes).split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--tp must list integers, comma-separated, got {self.tensor_parallel_sizes!r}") from None


def format_table(runs: Sequence[SystemRun]) -> List[str]:
    ours = next((r for r in runs if r.name.startswith(ENGINE_ROW)), None)
    header = (
        f"{'system':<34} {'input tokens':>12} {'output tokens':>13} {'time (s)':>9} "
        f"{'throughput (tok/s)':>18} {'ours/this':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in runs:
        ratio = ours.tok_per_s / r.tok_per_s if ours and r.tok_per_s else float("nan")
        lines.append(
            f"{r.name:<34} {r.input_tokens:>12,} {r.output_tokens:>13,} {r.seconds:>9.2f} "
            f"{r.tok_per_s:>18,.1f} {ratio:>8.2f}x"
        )
    for r in runs:
        status = "OK" if r.ok else f"MISMATCH ({r.mismatched_requests} requests off)"
        lines.append(f"token counts {r.name}: {status} ({r.output_tokens:,} of {r.expected_output_tokens:,})")
    for r in runs:
        if not r.name.startswith(ENGINE_ROW) or not r.extra.get("steps"):
            continue
        lines.append(format_host_line(r.name, r.seconds, r.extra["steps"], r.extra["host_seconds"]))
    engines = [r for r in runs if r.name.startswith(ENGINE_ROW)]
    for r in engines[1:]:
        lines.append(f"{r.name} over {engines[0].name}: {r.tok_per_s / engines[0].tok_per_s:.2f}x throughput")
    return lines


def run_nano_bench(opts: NanoOptions, print_fn: PrintFn = print) -> Dict[str, Any]:
    """Run the workload (and transformers with --compare), print everything; returns the raw numbers."""
    opts.resolve()
    device, dtype = opts.resolved()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    workload = nano_vllm(opts.num_requests, opts.max_input_len, opts.max_output_len, opts.seed)
    warm = warmup(opts.max_input_len, min(opts.warmup_requests, opts.num_requests), opts.seed)
    k = min(opts.profile_requests, len(workload))
    profiled = Workload("profile", workload.prompts[:k], [opts.profile_output_len] * k)

    if opts.model is None and opts.model_config is not None:
        _, opts.hf_config, opts.model_config_path = resolve_model_config(opts.model_config)
    source, dummy, model_desc = model_source(opts.model, opts.model_config)
    d = workload.describe()
    print_fn(
        f"workload {NANO_VLLM}: {d['num_requests']} requests, input {d['input_len_range'][0]}-"
        f"{d['input_len_range'][1]} tokens ({d['input_tokens']:,} total), output {d['output_len_range'][0]}-"
        f"{d['output_len_range'][1]} tokens ({d['output_tokens']:,} total), greedy, ignore EOS, seed {opts.seed}"
    )

    # bandwidth first, while the device memory is free
    bandwidth: Dict[str, Any]
    if opts.bandwidth_gbs:
        bandwidth = {"source": "given", "method": "--bandwidth-gbs", "bytes_per_s": opts.bandwidth_gbs * 1e9}
    else:
        bandwidth = measure_bandwidth(device, opts.bandwidth_nbytes())

    page = opts.page_size
    everything = (workload, warm, profiled)
    longest = max(len(p) + m for w in everything for p, m in zip(w.prompts, w.max_tokens))
    max_seq_len = pages(max(longest, opts.max_input_len + opts.max_output_len) + 1, page) * page
    # the KV pool: as asked, else sized from free memory on CUDA, else what the workload needs with
    # every request running at once
    need = max(w.kv_tokens(page) for w in everything)
    kv_tokens = opts.kv_cache_tokens if opts.kv_cache_tokens is not None else (None if opts.cuda else need)
    runs: List[SystemRun] = []
    breakdowns: Dict[int, Any] = {}
    sizes = opts.tp_sizes()
    for size in sizes:
        opts.tensor_parallel_size = size
        kw = engine_kwargs(opts, dummy_weights=dummy, max_seq_len=max_seq_len, kv_cache_tokens=kv_tokens)
        llm = build_llm(source, kw)
        try:
            config = llm.model_config
            if not runs:
                print_fn(
                    f"model {model_desc}: {param_count(config):,} params, {dtype} on {device} "
                    f"({device_name(device)}); torch {torch.__version__}, transformers "
                    f"{versions()['transformers']}"
                )
            run = run_workload(llm, workload, warm, device)
            name = f"{ENGINE_ROW} tp={size}" if len(sizes) > 1 else ENGINE_ROW
            # the scheduler's own counters: host seconds per part of a step, steps per phase
            pool = llm.engine.config.pool_tokens
            runs.append(
                SystemRun.of(
                    name,
                    run,
                    workload,
                    host_seconds=run.stats.host_seconds,
                    steps=run.stats.steps,
                    tensor_parallel_size=size,
                    kv_pool_tokens=pool,
                )
            )
            if k and opts.profile_output_len > 1:  # rank 0's GPU: its kernels and its all-reduces
                breakdowns[size] = profile_decode(llm, profiled.prompts, profiled.max_tokens, device)
        finally:
            llm.close()
            del llm
            free_memory(device)
    breakdown = breakdowns.get(sizes[0])

    if opts.compare == "transformers":
        hf = build_hf_model(dtype, device, opts.hf_attn, opts.model, opts.hf_config)
        try:
            runs.append(run_continuous_batching(hf, workload, warm, device, opts.hf_max_batch_tokens))
        finally:
            del hf
            free_memory(device)

    itemsize = DTYPES[dtype].itemsize
    prompt_lens = [len(p) for p in workload.prompts]
    floor = decode_floor(config, itemsize, prompt_lens, workload.max_tokens, bandwidth["bytes_per_s"])
    print_lines(format_table(runs), print_fn)
    print_lines(format_floor(floor, bandwidth, runs[0].seconds), print_fn)
    fp8_floor = None
    if opts.kv_cache_dtype == "fp8_e4m3":  # the cache stores 1 byte per value: the floor moves
        fp8_floor = decode_floor(
            config, itemsize, prompt_lens, workload.max_tokens, bandwidth["bytes_per_s"], kv_itemsize=1
        )
        print_fn("with the FP8 KV cache (1 byte per K/V value):")
        print_lines(format_floor(fp8_floor, bandwidth, runs[0].seconds), print_fn)
    for size, b in breakdowns.items():
        if len(sizes) > 1:
            print_fn(f"tensor-parallel size {size} (rank 0):")
        print_lines(format_breakdown(b), print_fn)

    opts_dict = {k2: (str(v) if isinstance(v, Path) else v) for k2, v in asdict(opts).items() if k2 != "hf_config"}
    report = {
        "workload": d,
        "options": opts_dict,
        "model": {"source": model_desc, "config": asdict(config), "params": param_count(config)},
        "dtype": dtype,
        "device": device,
        "device_name": device_name(device),
        "versions": versions(),
        "engine_kwargs": kw,
        "systems": [r.as_dict() for r in runs],
        "ratio_ours_over_transformers": (runs[0].tok_per_s / runs[1].tok_per_s) if len(runs) > 1 else None,
        "bandwidth": bandwidth,
        "floor": {
            **floor,
            "fraction_of_floor_reached": floor["seconds"] / runs[0].seconds if runs[0].seconds else None,
        },
        "fp8_kv_floor": fp8_floor,
        "breakdown": breakdown,
        "breakdown_per_tp_size": breakdowns,
        "ok": all(r.ok for r in runs),
    }
    write_report(report, opts.output, print_fn)
    if opts.cuda:
        free_memory(device)
    return report
