"""`kvledger bench`: one offline workload on this engine and on transformers, side by side.

The workload is seeded random token-id prompts (lengths in [min_len, max_len]) that each generate
exactly `output_len` tokens (greedy, EOS ignored). It runs, in this process and with the same
weights, dtype and thread count, on:

1. this engine (`LLM.generate`, continuous batching over the paged KV pool);
2. transformers `generate` as one static batch (left padding, attention mask);
3. transformers continuous batching (`model.generate_batch`, paged KV).

Wall time covers prefill and decode, not model loading; each system first runs a tiny warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch

from kvledger.bench.hf import HF_GENERATE, load_hf_model, run_hf_generate, run_hf_generate_batch
from kvledger.bench.runner import ENGINE_ROW, PrintFn, SystemRun, build_llm, run_workload
from kvledger.bench.workloads import Workload, pages, random_prompts

DTYPES = ("float32", "bfloat16")
ENGINE_PREFILL_TOKENS = 2048  # the engine's max_prefill_tokens (LLM's default)


@dataclass
class BenchReport:
    workload: Workload
    dtype: str
    threads: int
    results: List[SystemRun] = field(default_factory=list)

    def result(self, name: str) -> Optional[SystemRun]:
        return next((r for r in self.results if r.name == name), None)


def run_engine(workload: Workload, dtype: str, model_path: Optional[str] = None) -> SystemRun:
    page = 16
    n = workload.uniform_max_tokens
    llm = build_llm(
        model_path,
        dict(
            dtype=dtype,
            page_size=page,
            kv_cache_tokens=max(workload.kv_tokens(page, spare=0), 4 * page),
            max_running_req=max(64, len(workload)),
            max_prefill_tokens=ENGINE_PREFILL_TOKENS,
            # a multiple of the page size: the scheduler's page table is max_seq_len wide
            max_seq_len=pages(max(len(p) for p in workload.prompts) + n + 1, page) * page,
        ),
    )
    warm = Workload("warm-up", [p[:8] for p in workload.prompts[:2]], [2] * min(2, len(workload)))
    return SystemRun.of(ENGINE_ROW, run_workload(llm, workload, warm, "cpu"), workload)


def run_bench(
    prompts: int = 32,
    min_len: int = 32,
    max_len: int = 256,
    output_len: int = 64,
    dtype: str = "float32",
    threads: Optional[int] = None,
    seed: int = 0,
    skip_transformers: bool = False,
    model_path: Optional[str] = None,
    print_fn: PrintFn = print,
) -> BenchReport:
    """Run the workload on every system and print the table; returns the measurements."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if threads:
        torch.set_num_threads(threads)
    workload = random_prompts(prompts, min_len, max_len, output_len, seed)
    report = BenchReport(workload, dtype, torch.get_num_threads())
    print_fn(
        f"workload: {prompts} prompts of {min_len}-{max_len} tokens ({workload.input_tokens} input tokens), "
        f"{output_len} output tokens each, greedy, ignore EOS; dtype {dtype}, {report.threads} threads, seed {seed}"
    )
    report.results.append(run_engine(workload, dtype, model_path))
    if not skip_transformers:
        hf = load_hf_model(dtype, model_path)
        report.results.append(run_hf_generate(hf, workload))
        report.results.append(run_hf_generate_batch(hf, workload, ENGINE_PREFILL_TOKENS))
        del hf
    for line in format_report(report):
        print_fn(line)
    return report


def format_report(report: BenchReport) -> List[str]:
    ours = report.result(ENGINE_ROW)
    header = f"{'system':<28} {'output tokens':>13} {'seconds':>9} {'tok/s':>9} {'ours/this':>9}"
    lines = [header, "-" * len(header)]
    for r in report.results:
        ratio = ours.tok_per_s / r.tok_per_s if ours and r.tok_per_s else float("nan")
        lines.append(f"{r.name:<28} {r.output_tokens:>13} {r.seconds:>9.2f} {r.tok_per_s:>9.1f} {ratio:>8.2f}x")
    expected = report.workload.output_tokens
    ok = all(r.ok for r in report.results)
    counts = ", ".join(f"{r.name}={r.output_tokens}" for r in report.results)
    lines.append(f"token counts: {'OK' if ok else 'MISMATCH'} (expected {expected}: {counts})")
    hf = report.result(HF_GENERATE)
    if ours and hf:
        if report.dtype == "float32":
            mine, theirs = ours.outputs or [], hf.outputs or []
            same = sum(a == b for a, b in zip(mine, theirs))
            lines.append(f"greedy match vs {HF_GENERATE}: {same}/{len(mine)} sequences identical (informational)")
        else:
            lines.append(f"greedy match vs {HF_GENERATE}: skipped ({report.dtype}; float32 only)")
    return lines
