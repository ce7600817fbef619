"""`kvledger bench --workload shared-prefix`: groups of requests that share a long prefix, radix
cache against the naive one in the same run.

The workload follows SGLang's generated-shared-prefix benchmark: `--groups` groups of
`--group-size` requests; every request of a group starts with the group's `--prefix-len` random
token ids and ends with its own `--question-len` ones; each generates exactly `--answer-len`
tokens (greedy, EOS ignored). The requests are shuffled with `--seed`, so a group's requests
arrive spread over the run. Defaults: 32 x 16 requests, a 2,048-token prefix, 256-token
questions, 256 output tokens, 256 running at most.

Per cache it prints output tok/s, the prefix hit rate (prompt tokens found in the prefix cache at
admission over all prompt tokens) and the prefill tokens computed (prompt tokens minus hits).
`radix` decodes with cascade attention (a prefix shared by running requests is read once per
group; Triton backend); `radix-flat` is the radix cache with it off, each request reading its
whole context, so the two show what prefix-aware decode adds to prefix-aware prefill.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List

from kvledger.bench.decode_profile import format_breakdown, profile_decode
from kvledger.bench.runner import (
    BenchOptions,
    EngineRun,
    PrintFn,
    build_llm,
    device_name,
    engine_kwargs,
    format_host_line,
    free_memory,
    model_source,
    print_lines,
    run_workload,
    versions,
    write_report,
)
from kvledger.bench.workloads import SHARED_PREFIX, Workload, pages, shared_prefix
from kvledger.engine.engine_config import EngineConfig

CACHES = ("radix", "radix-flat", "naive")


@dataclass
class CacheRun:
    cache: str
    seconds: float
    output_tokens: int
    expected_output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    steps: Dict[str, int] = field(default_factory=dict)
    kv_pool_tokens: int = 0
    host_seconds: Dict[str, float] = field(default_factory=dict)  # the scheduler's, by part of a step

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("inf")

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_computed(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def ok(self) -> bool:
        return self.output_tokens == self.expected_output_tokens

    def as_dict(self) -> Dict[str, Any]:
        return {
            **asdict(self),
            "tok_per_s": self.tok_per_s,
            "prefix_hit_rate": self.hit_rate,
            "prefill_tokens_computed": self.prefill_computed,
            "token_counts_ok": self.ok,
        }

    @classmethod
    def of(cls, cache: str, run: EngineRun, workload: Workload, kv_pool_tokens: int) -> CacheRun:
        return cls(
            cache,
            run.seconds,
            run.output_tokens,
            workload.output_tokens,
            workload.input_tokens,
            sum(run.cached_tokens),
            run.stats.steps,
            kv_pool_tokens,
            run.stats.host_seconds,
        )


def format_table(runs: List[CacheRun]) -> List[str]:
    header = (
        f"{'cache':<10} {'time (s)':>9} {'throughput (tok/s)':>18} {'prefix hit rate':>15} "
        f"{'prefill tokens computed':>23} {'steps (prefill+decode)':>22} {'KV pool tokens':>14}"
    )
    lines = [header, "-" * len(header)]
    for r in runs:
        steps = f"{r.steps.get('prefill', 0):,}+{r.steps.get('decode', 0):,}"
        lines.append(
            f"{r.cache:<10} {r.seconds:>9.2f} {r.tok_per_s:>18,.1f} {100 * r.hit_rate:>14.1f}% "
            f"{r.prefill_computed:>23,} {steps:>22} {r.kv_pool_tokens:>14,}"
        )
    for r in runs:
        lines.append(format_host_line(r.cache, r.seconds, r.steps, r.host_seconds))
    for r in runs:
        status = "OK" if r.ok else "MISMATCH"
        lines.append(f"token counts {r.cache}: {status} ({r.output_tokens:,} of {r.expected_output_tokens:,})")
    by = {r.cache: r for r in runs}
    if "radix" in by and "naive" in by and by["naive"].tok_per_s:
        lines.append(
            f"radix over naive: {by['radix'].tok_per_s / by['naive'].tok_per_s:.2f}x throughput, "
            f"{by['naive'].prefill_computed / max(1, by['radix'].prefill_computed):.2f}x fewer prefill tokens"
        )
    if "radix" in by and "radix-flat" in by and by["radix-flat"].tok_per_s:
        lines.append(
            f"cascade decode attention: {by['radix'].tok_per_s / by['radix-flat'].tok_per_s:.2f}x the "
            f"throughput of the radix cache without it"
        )
    return lines


@dataclass
class SharedPrefixOptions(BenchOptions):
    groups: int = 32
    group_size: int = 16
    prefix_len: int = 2048
    question_len: int = 256
    answer_len: int = 256
    caches: str = "radix,naive"
    kv_cache_dtype: str = EngineConfig.kv_cache_dtype
    profile_requests: int = 256
    profile_output_len: int = 32

    def resolve(self) -> SharedPrefixOptions:
        self.resolve_device()
        bad = [c for c in self.cache_list() if c not in CACHES]
        if bad or not self.cache_list():
            raise ValueError(f"caches must list {' and/or '.join(CACHES)}, comma-separated, got {self.caches!r}")
        return self

    def cache_list(self) -> List[str]:
        return [c.strip() for c in self.caches.split(",") if c.strip()]


def run_shared_prefix_bench(opts: SharedPrefixOptions, print_fn: PrintFn = print) -> Dict[str, Any]:
    from kvledger.engine.model.weights import model_config

    opts.resolve()
    device, dtype = opts.resolved()
    source, dummy, desc = model_source(opts.model, opts.model_config)
    vocab = model_config(source).vocab_size
    w = shared_prefix(
        opts.groups, opts.group_size, opts.prefix_len, opts.question_len, opts.answer_len, vocab, opts.seed
    )
    warm = shared_prefix(2, 2, 16, 16, 4, vocab, opts.seed + 1)  # other prefixes: no head start
    print_fn(
        f"workload {SHARED_PREFIX}: {opts.groups} groups x {opts.group_size} requests, "
        f"{opts.prefix_len}-token shared prefix + {opts.question_len}-token question each "
        f"({w.input_tokens:,} prompt tokens), "
        f"{opts.answer_len} output tokens each, greedy, EOS ignored, shuffled with seed {opts.seed}"
    )
    page = opts.page_size
    longest = opts.prefix_len + opts.question_len + opts.answer_len + 1
    kw = engine_kwargs(opts, dummy_weights=dummy, max_seq_len=pages(longest, page) * page)
    if kw["kv_cache_tokens"] is None and not opts.cuda:
        # the CPU has no free-memory rule: room for every request at once, without sharing
        kw["kv_cache_tokens"] = pages(longest, page) * page * min(opts.max_running_req, len(w))
    runs: List[CacheRun] = []
    profiles: Dict[str, Dict[str, Any]] = {}
    print_fn(f"model {desc}, {dtype} on {device} ({device_name(device)}); {opts.max_running_req} running at most")
    for cache in opts.cache_list():
        cascade = cache != "radix-flat"
        with build_llm(source, kw, cache_type=cache.split("-")[0], cascade_attention=cascade) as llm:
            runs.append(
                CacheRun.of(cache, run_workload(llm, w, warm, device), w, kv_pool_tokens=llm.engine.config.pool_tokens)
            )
            k = min(opts.profile_requests, len(w))
            if k > 0:  # the first requests again, their prefixes as cached as in the run
                profiles[cache] = profile_decode(llm, w.prompts[:k], [opts.profile_output_len] * k, device)
        del llm  # before sizing the next engine's pool from free memory
        free_memory(device)
    print_lines(format_table(runs), print_fn)
    for cache, breakdown in profiles.items():
        print_fn(f"[{cache}]")
        print_lines(format_breakdown(breakdown), print_fn)
    report = {
        "workload": w.describe(),
        "model": desc,
        "device_name": device_name(device),
        "versions": versions(),
        "engine_kwargs": kw,
        "runs": [r.as_dict() for r in runs],
        "decode_profiles": profiles,
        "ok": all(r.ok for r in runs),
    }
    write_report(report, opts.output, print_fn)
    return report
