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

import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from kvledger.bench.decode_profile import format_breakdown, profile_decode, sync
from kvledger.bench.nano import NANO_VOCAB_MAX, _device_name, _free_memory, _pages, _versions, \
    default_device_and_dtype, format_host_line, resolve_model_config
from kvledger.engine.engine_config import EngineConfig

WORKLOAD = "shared-prefix"
CACHES = ("radix", "radix-flat", "naive")


@dataclass
class SharedPrefixWorkload:
    prompts: List[List[int]]
    group_of: List[int]  # each request's group
    prefix_len: int
    question_len: int
    answer_len: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return self.answer_len * len(self.prompts)


def make_workload(groups: int, group_size: int, prefix_len: int, question_len: int, answer_len: int,
                  vocab: int, seed: int = 0) -> SharedPrefixWorkload:
    for name, value in (("groups", groups), ("group_size", group_size), ("question_len", question_len),
                        ("answer_len", answer_len)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be at least 0, got {prefix_len}")
    rng = random.Random(seed)
    high = min(vocab, NANO_VOCAB_MAX) - 1
    requests = []
    for g in range(groups):
        prefix = [rng.randint(0, high) for _ in range(prefix_len)]
        for _ in range(group_size):
            requests.append((g, prefix + [rng.randint(0, high) for _ in range(question_len)]))
    rng.shuffle(requests)
    return SharedPrefixWorkload([p for _, p in requests], [g for g, _ in requests], prefix_len, question_len,
                                answer_len)


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
        return {**asdict(self), "tok_per_s": self.tok_per_s, "prefix_hit_rate": self.hit_rate,
                "prefill_tokens_computed": self.prefill_computed, "token_counts_ok": self.ok}


def run_cache(llm, workload: SharedPrefixWorkload, warm: List[List[int]], device: str, label: str) -> CacheRun:
    from kvledger.fast import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=workload.answer_len)
    for o in llm.generate(warm, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4), use_tqdm=False):
        if o.error is not None:
            raise o.error
    sync(device)
    steps0, host0 = dict(llm.scheduler.steps), dict(llm.scheduler.host_seconds)
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=False)
    sync(device)
    seconds = time.perf_counter() - start
    for o in outs:
        if o.error is not None:
            raise o.error
    return CacheRun(label, seconds, sum(len(o.token_ids) for o in outs), workload.output_tokens,
                    workload.prompt_tokens, sum(o.cached_tokens for o in outs),
                    {k: v - steps0[k] for k, v in llm.scheduler.steps.items()},
                    host_seconds={k: v - host0.get(k, 0.0) for k, v in llm.scheduler.host_seconds.items()})


def format_table(runs: List[CacheRun]) -> List[str]:
    header = (f"{'cache':<10} {'time (s)':>9} {'throughput (tok/s)':>18} {'prefix hit rate':>15} "
              f"{'prefill tokens computed':>23} {'steps (prefill+decode)':>22} {'KV pool tokens':>14}")
    lines = [header, "-" * len(header)]
    for r in runs:
        steps = f"{r.steps.get('prefill', 0):,}+{r.steps.get('decode', 0):,}"
        lines.append(f"{r.cache:<10} {r.seconds:>9.2f} {r.tok_per_s:>18,.1f} {100 * r.hit_rate:>14.1f}% "
                     f"{r.prefill_computed:>23,} {steps:>22} {r.kv_pool_tokens:>14,}")
    for r in runs:
        lines.append(format_host_line(r.cache, r.seconds, r.steps, r.host_seconds))
    for r in runs:
        status = "OK" if r.ok else "MISMATCH"
        lines.append(f"token counts {r.cache}: {status} ({r.output_tokens:,} of {r.expected_output_tokens:,})")
    by = {r.cache: r for r in runs}
    if "radix" in by and "naive" in by and by["naive"].tok_per_s:
        lines.append(f"radix over naive: {by['radix'].tok_per_s / by['naive'].tok_per_s:.2f}x throughput, "
                     f"{by['naive'].prefill_computed / max(1, by['radix'].prefill_computed):.2f}x fewer prefill tokens")
    if "radix" in by and "radix-flat" in by and by["radix-flat"].tok_per_s:
        lines.append(f"cascade decode attention: {by['radix'].tok_per_s / by['radix-flat'].tok_per_s:.2f}x the "
                     f"throughput of the radix cache without it")
    return lines


@dataclass
class SharedPrefixOptions:
    model_config: str = "qwen3-0.6b"
    model: Optional[str] = None
    device: Optional[str] = None
    dtype: Optional[str] = None
    groups: int = 32
    group_size: int = 16
    prefix_len: int = 2048
    question_len: int = 256
    answer_len: int = 256
    caches: str = "radix,naive"
    seed: int = 0
    page_size: int = EngineConfig.page_size
    kv_cache_dtype: str = EngineConfig.kv_cache_dtype
    kv_cache_tokens: Optional[int] = None
    max_running_reqs: int = 256
    max_prefill_tokens: int = 16384
    cuda_graphs: Optional[bool] = None
    overlap: Optional[bool] = None
    attention: str = EngineConfig.attention
    threads: Optional[int] = None
    profile_requests: int = 256
    profile_output_len: int = 32
    output: Optional[str] = None

    def resolve(self) -> SharedPrefixOptions:
        self.device, self.dtype = default_device_and_dtype(self.device, self.dtype)
        if self.cuda_graphs is None:
            self.cuda_graphs = torch.device(self.device).type == "cuda"
        bad = [c for c in self.cache_list() if c not in CACHES]
        if bad or not self.cache_list():
            raise ValueError(f"caches must list {' and/or '.join(CACHES)}, comma-separated, got {self.caches!r}")
        return self

    def cache_list(self) -> List[str]:
        return [c.strip() for c in self.caches.split(",") if c.strip()]


def run_shared_prefix_bench(opts: SharedPrefixOptions, print_fn: Callable[[str], None] = print) -> Dict[str, Any]:
    from kvledger.engine.runtime.llm import LLM

    opts.resolve()
    if opts.model is not None:
        source, dummy, desc = opts.model, False, opts.model
    else:
        source, dummy, desc = str(resolve_model_config(opts.model_config)[2]), True, f"{opts.model_config} (random weights)"
    from kvledger.engine.model.weights import model_config

    vocab = model_config(source).vocab_size
    w = make_workload(opts.groups, opts.group_size, opts.prefix_len, opts.question_len, opts.answer_len, vocab,
                      opts.seed)
    warm = make_workload(2, 2, 16, 16, 4, vocab, opts.seed + 1).prompts  # other prefixes: no head start
    print_fn(f"workload {WORKLOAD}: {opts.groups} groups x {opts.group_size} requests, {opts.prefix_len}-token shared "
             f"prefix + {opts.question_len}-token question each ({w.prompt_tokens:,} prompt tokens), "
             f"{opts.answer_len} output tokens each, greedy, EOS ignored, shuffled with seed {opts.seed}")
    page = opts.page_size
    longest = opts.prefix_len + opts.question_len + opts.answer_len + 1
    kw: Dict[str, Any] = dict(
        dummy_weights=dummy, device=opts.device, dtype=opts.dtype, page_size=page, kv_cache_dtype=opts.kv_cache_dtype,
        kv_cache_tokens=opts.kv_cache_tokens, max_running_reqs=opts.max_running_reqs,
        max_seq_len=_pages(longest, page) * page, max_prefill_tokens=opts.max_prefill_tokens, seed=opts.seed,
        cuda_graphs=opts.cuda_graphs, overlap=opts.overlap, attention=opts.attention, threads=opts.threads)
    if kw["kv_cache_tokens"] is None and torch.device(opts.device).type != "cuda":
        # the CPU has no free-memory rule: room for every request at once, without sharing
        kw["kv_cache_tokens"] = _pages(longest, page) * page * min(opts.max_running_reqs, len(w.prompts))
    runs: List[CacheRun] = []
    profiles: Dict[str, Dict[str, Any]] = {}
    print_fn(f"model {desc}, {opts.dtype} on {opts.device} ({_device_name(opts.device)}); "
             f"{opts.max_running_reqs} running at most")
    for cache in opts.cache_list():
        with LLM(source, cache_type=cache.split("-")[0], cascade_attention=cache != "radix-flat", **kw) as llm:
            runs.append(run_cache(llm, w, warm, opts.device, cache))
            runs[-1].kv_pool_tokens = llm.scheduler.config.num_pages * page
            k = min(opts.profile_requests, len(w.prompts))
            if k > 0:  # the first requests again, their prefixes as cached as in the run
                profiles[cache] = profile_decode(llm, w.prompts[:k], [opts.profile_output_len] * k, opts.device)
        del llm  # before sizing the next engine's pool from free memory
        _free_memory(opts.device)
    for line in format_table(runs):
        print_fn(line)
    for cache, breakdown in profiles.items():
        print_fn(f"[{cache}]")
        for line in format_breakdown(breakdown):
            print_fn(line)
    report = {"workload": {"name": WORKLOAD, "groups": opts.groups, "group_size": opts.group_size,
                           "prefix_len": opts.prefix_len, "question_len": opts.question_len,
                           "answer_len": opts.answer_len, "prompt_tokens": w.prompt_tokens,
                           "output_tokens": w.output_tokens, "seed": opts.seed},
              "model": desc, "device_name": _device_name(opts.device), "versions": _versions(), "engine_kwargs": kw,
              "runs": [r.as_dict() for r in runs], "decode_profiles": profiles, "ok": all(r.ok for r in runs)}
    if opts.output:
        Path(opts.output).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print_fn(f"wrote {opts.output}")
    return report


def options_from_args(args) -> SharedPrefixOptions:
    names = SharedPrefixOptions.__dataclass_fields__
    return SharedPrefixOptions(**{n: getattr(args, n) for n in names if hasattr(args, n)})


def main_shared_prefix_bench(args) -> int:
    try:
        report = run_shared_prefix_bench(options_from_args(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"kvledger bench --workload {WORKLOAD}: {e}", file=sys.stderr)
        return 2
    return 0 if report["ok"] else 1
