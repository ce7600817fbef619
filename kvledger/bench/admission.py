"""`kvledger bench --workload early-stop`: reserve vs optimistic admission when the scheduler does not
know how long each output will be.

The workload (`workloads.early_stop`, drawn from `random.Random(seed)` alone, in this order):
`--num-requests` prompts of uniform length in [100/1024 of `--max-input-len`, `--max-input-len`]
(nano-vllm's bounds), token ids uniform in [0, 10000]; then one output length per request from a
lognormal, `round(exp(N(ln median, sigma)))`, clamped to [1, max_tokens]. Defaults: on CUDA 256
requests, prompts 100-1024 (nano-vllm's very prompts), max_tokens 2048, median 200 and sigma 1.0
(a distribution of mean 330 and p90 720, 1% at the cap: the long-tailed shape of chat answers,
e.g. ShareGPT's; seed 0 draws mean 280, median 164, p90 616, two at 2048); on the CPU 24
requests, prompts 12-128, max_tokens 256 and the median scaled with max_tokens (25), same sigma.

Every request asks `max_tokens` (greedy, EOS ignored), so that is all the scheduler knows. The
bench drives `llm.engine` itself (`runner.step_loop`): it counts the tokens each request
delivers and aborts the request as soon as its count reaches its drawn length, as an EOS would end
it (an abort releases the request's KV to the prefix cache, like a finish). A request drawn at
max_tokens ends by length.

The KV pool is the same for every run and limits concurrency: by default it holds
ceil(min(max_running_req, requests) / 8) worst cases (the longest prompt plus max_tokens, whole
pages), so reserve admission, which reserves each request's worst case, runs about an eighth of
the requests it otherwise could. On CUDA that is 32 x 3072 = 98,304 tokens (11.3 GB for the
Qwen3-0.6B shape in bf16); on the CPU 3 x 384 = 1,152 tokens.

In one process, back to back, one engine each (same weights, pool and workload): reserve, then
every other `--policies` entry at each of `--ratios`. Before timing, each engine runs a few short
warm-up requests (the Triton kernels and CUDA graphs). Per run: output tokens delivered, wall
seconds (submit to the last token, prefill included), output tok/s, mean and peak decode batch
(over decode steps), decode steps, preemptions and recomputed KV tokens (the cache scheduler's
counters), and the speedup over reserve.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from kvledger.bench.bandwidth_floor import param_count
from kvledger.bench.runner import (
    BenchOptions,
    EngineRun,
    PrintFn,
    build_llm,
    device_name,
    engine_kwargs,
    free_memory,
    model_source,
    print_lines,
    run_workload,
    versions,
    write_report,
)
from kvledger.bench.workloads import EARLY_STOP, EARLY_STOP_RATIOS, Workload, early_stop, pages, warmup
from kvledger.engine.model.config import ModelConfig
from kvledger.engine.options import ADMISSION_POLICIES

# defaults on CUDA, and on the CPU (where the three runs take a few minutes)
CUDA_DEFAULTS = {"num_requests": 256, "max_input_len": 1024, "max_tokens": 2048}
CPU_DEFAULTS = {"num_requests": 24, "max_input_len": 128, "max_tokens": 256}
MEDIAN_PER_MAX_TOKENS = 200 / 2048  # the default median output length, as a fraction of max_tokens
POOL_DIVISOR = 8  # the default pool holds this fraction (1/8) of the concurrent requests' worst cases
WARMUP = {"cuda": (8, 8), "cpu": (1, 2)}  # warm-up requests and their max_tokens


# ------------------------------------------------------------------------------------ workload


def worst_case_tokens(workload: Workload, page_size: int) -> int:
    """KV of the longest request at its worst case (longest prompt plus max_tokens), whole pages."""
    return pages(max(len(p) for p in workload.prompts) + workload.uniform_max_tokens, page_size) * page_size


def default_kv_cache_tokens(workload: Workload, max_running_req: int, page_size: int) -> int:
    """Room for ceil(min(max_running_req, requests) / 8) worst cases: reserve runs about an eighth of
    the requests that could run at once."""
    cases = max(1, -(-min(max_running_req, len(workload)) // POOL_DIVISOR))
    return cases * worst_case_tokens(workload, page_size)


# ------------------------------------------------------------------------------------ one run


@dataclass
class PolicyRun:
    policy: str
    reserve_ratio: Optional[float]  # None for reserve
    output_tokens: int  # tokens delivered
    expected_output_tokens: int
    seconds: float
    mismatched_requests: int  # requests that did not deliver exactly their drawn length
    errors: Dict[int, str]  # uid -> a request's failure
    decode_steps: int
    prefill_steps: int
    decode_batch_sum: int
    peak_batch: int
    preemptions: int
    recomputed_tokens: int
    stopped_early: int  # requests the bench aborted at their drawn length
    finished_by_length: int  # requests drawn at max_tokens, ended by the engine
    host_seconds: Dict[str, float] = field(default_factory=dict)  # the scheduler's, per part of a step

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("inf")

    @property
    def mean_batch(self) -> float:
        return self.decode_batch_sum / self.decode_steps if self.decode_steps else 0.0

    @property
    def recomputed_fraction(self) -> float:
        return self.recomputed_tokens / self.output_tokens if self.output_tokens else 0.0

    @property
    def ok(self) -> bool:
        return not self.mismatched_requests and not self.errors and self.output_tokens == self.expected_output_tokens

    @property
    def label(self) -> str:
        return self.policy if self.reserve_ratio is None else f"{self.policy} {self.reserve_ratio:g}"

    def as_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["errors"] = {str(k): v for k, v in self.errors.items()}
        d.update(
            tok_per_s=self.tok_per_s,
            mean_batch=self.mean_batch,
            recomputed_fraction=self.recomputed_fraction,
            token_counts_ok=self.ok,
        )
        return d

    @classmethod
    def of(cls, policy: str, ratio: Optional[float], run: EngineRun, workload: Workload) -> PolicyRun:
        b = run.batches
        by_length = len(workload) - run.stopped_early - len(run.errors)
        return cls(
            policy,
            ratio,
            run.output_tokens,
            workload.output_tokens,
            run.seconds,
            run.mismatched(workload),
            run.errors,
            b.decode_steps,
            b.prefill_steps,
            b.batch_sum,
            b.peak,
            run.stats.preemptions,
            run.stats.recomputed_tokens,
            run.stopped_early,
            by_length,
            {**run.stats.host_seconds, "abort": run.abort_seconds},
        )


def run_policy(
    llm: Any, workload: Workload, policy: str, ratio: Optional[float], warm: Workload, device: str
) -> PolicyRun:
    return PolicyRun.of(policy, ratio, run_workload(llm, workload, warm, device), workload)


# ------------------------------------------------------------------------------------ options


@dataclass
class EarlyStopOptions(BenchOptions):
    model_config: Optional[str] = None  # random weights of this config (default: qwen3-0.6b on CUDA, the
    # embedded model on the CPU)
    num_requests: Optional[int] = None
    max_input_len: Optional[int] = None
    max_tokens: Optional[int] = None
    output_median: Optional[float] = None
    output_sigma: float = 1.0
    policies: str = "reserve,optimistic"
    ratios: str = EARLY_STOP_RATIOS

    def resolve(self) -> EarlyStopOptions:
        self.resolve_device()
        defaults = CUDA_DEFAULTS if self.cuda else CPU_DEFAULTS
        self.num_requests = defaults["num_requests"] if self.num_requests is None else self.num_requests
        self.max_input_len = defaults["max_input_len"] if self.max_input_len is None else self.max_input_len
        max_tokens = self.max_tokens = defaults["max_tokens"] if self.max_tokens is None else self.max_tokens
        if self.output_median is None:
            self.output_median = max_tokens * MEDIAN_PER_MAX_TOKENS
        if self.model is None and self.model_config is None and self.cuda:
            self.model_config = "qwen3-0.6b"
        self.run_list()  # check them now
        return self

    def sizes(self) -> Tuple[int, int, int, float]:
        """(num_requests, max_input_len, max_tokens, output_median), once `resolve` has filled them in."""
        n, input_len, max_tokens, median = self.num_requests, self.max_input_len, self.max_tokens, self.output_median
        if n is None or input_len is None or max_tokens is None or median is None:
            raise RuntimeError("EarlyStopOptions.resolve() has not run")
        return n, input_len, max_tokens, median

    def run_list(self) -> List[Tuple[str, Optional[float]]]:
        """(policy, reserve ratio) per run: reserve first, then each other policy at each ratio."""
        policies = [p.strip() for p in self.policies.split(",") if p.strip()]
        for p in policies:
            if p not in ADMISSION_POLICIES:
                raise ValueError(f"policies: {p!r} is not an admission policy ({', '.join(ADMISSION_POLICIES)})")
        try:
            ratios = [float(r) for r in self.ratios.split(",") if r.strip()]
        except ValueError:
            raise ValueError(f"ratios: expected comma-separated numbers in [0, 1], got {self.ratios!r}") from None
        if any(not 0.0 <= r <= 1.0 for r in ratios):
            raise ValueError(f"ratios: each must be in [0, 1], got {self.ratios!r}")
        runs: List[Tuple[str, Optional[float]]] = [("reserve", None)]
        for p in dict.fromkeys(policies):
            if p != "reserve":
                if not ratios:
                    raise ValueError(f"ratios: policy {p} needs at least one ratio")
                runs += [(p, r) for r in ratios]
        return runs


# ------------------------------------------------------------------------------------ report


def format_workload(d: Dict[str, Any]) -> List[str]:
    dist = d["output_distribution"]
    return [
        f"workload {EARLY_STOP}: {d['num_requests']} requests, prompts {d['input_len_range'][0]}-"
        f"{d['input_len_range'][1]} tokens ({d['input_tokens']:,} total), max_tokens {d['max_tokens']:,} each "
        f"(all the scheduler knows), greedy, seed {d['seed']}",
        f"output lengths (the bench ends each request there, unknown to the scheduler): lognormal median "
        f"{dist['median']:g}, sigma {dist['sigma']:g}, clamped to [1, {d['max_tokens']:,}]: mean "
        f"{d['output_len_mean']:.1f}, median {d['output_len_median']:g}, p90 {d['output_len_p90']:,}, max "
        f"{d['output_len_max']:,}, {d['requests_at_max_tokens']} at max_tokens; {d['output_tokens']:,} output tokens "
        f"({100 * d['output_fraction_of_max_tokens']:.1f}% of what max_tokens allows)",
    ]


def format_table(runs: Sequence[PolicyRun]) -> List[str]:
    base = next((r for r in runs if r.policy == "reserve"), None)
    header = (
        f"{'policy':<16} {'output tokens':>13} {'time (s)':>9} {'tok/s':>10} {'mean batch':>10} "
        f"{'peak batch':>10} {'decode steps':>12} {'preemptions':>11} {'recomputed':>10} {'recomp/out':>10} "
        f"{'vs reserve':>10}"
    )
    lines = [header, "-" * len(header)]
    for r in runs:
        speedup = r.tok_per_s / base.tok_per_s if base is not None and base.tok_per_s else float("nan")
        lines.append(
            f"{r.label:<16} {r.output_tokens:>13,} {r.seconds:>9.2f} {r.tok_per_s:>10,.1f} "
            f"{r.mean_batch:>10.1f} {r.peak_batch:>10,} {r.decode_steps:>12,} {r.preemptions:>11,} "
            f"{r.recomputed_tokens:>10,} {100 * r.recomputed_fraction:>9.2f}% {speedup:>9.2f}x"
        )
    for r in runs:
        status = (
            "OK"
            if r.ok
            else (
                f"MISMATCH ({r.mismatched_requests} requests off, {len(r.errors)} failed"
                + (f": {next(iter(r.errors.values()))}" if r.errors else "")
                + ")"
            )
        )
        lines.append(
            f"token counts {r.label}: {status} ({r.output_tokens:,} of {r.expected_output_tokens:,}; "
            f"{r.stopped_early} stopped early by the bench, {r.finished_by_length} by max_tokens; "
            f"{r.prefill_steps:,} prefill steps)"
        )
    for r in runs:
        n = max(1, r.decode_steps + r.prefill_steps)
        parts = ", ".join(f"{k} {1000 * v / n:.2f}" for k, v in r.host_seconds.items())
        lines.append(
            f"per step {r.label}: {1000 * r.seconds / n:.2f} ms wall; host ms: {parts} (land includes wait, "
            f"the host blocked on the device)"
        )
    return lines


# ------------------------------------------------------------------------------------ the bench


def run_early_stop_bench(opts: EarlyStopOptions, print_fn: PrintFn = print) -> Dict[str, Any]:
    opts.resolve()
    device, dtype = opts.resolved()
    num_requests, max_input_len, max_tokens, output_median = opts.sizes()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    workload = early_stop(num_requests, max_input_len, max_tokens, output_median, opts.output_sigma, opts.seed)
    n_warm, warm_tokens = WARMUP["cuda" if opts.cuda else "cpu"]
    warm = warmup(max_input_len, n_warm, opts.seed, warm_tokens)
    d = workload.describe()
    print_lines(format_workload(d), print_fn)

    page = opts.page_size
    worst = worst_case_tokens(workload, page)
    kv_tokens = opts.kv_cache_tokens
    if kv_tokens is None:
        kv_tokens = default_kv_cache_tokens(workload, opts.max_running_req, page)
    kv_tokens = kv_tokens // page * page
    if kv_tokens < worst:
        raise ValueError(f"kv_cache_tokens {kv_tokens} is under one request's worst case ({worst} tokens)")
    longest = max(len(p) for p in workload.prompts + warm.prompts) + max(max_tokens, warm_tokens)
    source, dummy, model_desc = model_source(opts.model, opts.model_config)
    kwargs = engine_kwargs(
        opts, dummy_weights=dummy, kv_cache_tokens=kv_tokens, max_seq_len=pages(longest + 1, page) * page
    )
    mean_prompt = workload.input_tokens / len(workload)
    pool = {
        "tokens": kv_tokens,
        "worst_case_tokens": worst,
        "reserve_fits_worst_cases": kv_tokens // worst,
        "rule": "given"
        if opts.kv_cache_tokens is not None
        else f"ceil(min(max_running_req, requests) / {POOL_DIVISOR}) worst cases (longest prompt + max_tokens)",
    }
    print_fn(
        f"KV pool {kv_tokens:,} tokens ({pool['rule']}): {kv_tokens // worst} worst cases of {worst:,} tokens; "
        f"reserve admits about {kv_tokens / (mean_prompt + max_tokens):.1f} requests of a mean "
        f"prompt at once; max_running_req {opts.max_running_req}, same pool for every run"
    )

    runs: List[PolicyRun] = []
    config: Optional[ModelConfig] = None
    for policy, ratio in opts.run_list():
        per_run = {} if ratio is None else {"reserve_ratio": ratio}
        llm = build_llm(source, kwargs, admission=policy, **per_run)
        if config is None:
            config = llm.model_config
            print_fn(
                f"model {model_desc}: {param_count(config):,} params, {dtype} on {device} "
                f"({device_name(device)}); torch {torch.__version__}"
            )
        try:
            run = run_policy(llm, workload, policy, ratio, warm, device)
        finally:
            del llm
            free_memory(device)
        runs.append(run)
        print_fn(f"  ran {run.label}: {run.seconds:.2f} s")

    if config is None:
        raise ValueError("early-stop: --policies lists no run")
    print_lines(format_table(runs), print_fn)
    base = runs[0]
    report = {
        "workload": d,
        "options": asdict(opts),
        "model": {"source": model_desc, "config": asdict(config), "params": param_count(config)},
        "dtype": dtype,
        "device": device,
        "device_name": device_name(device),
        "versions": versions(),
        "engine_kwargs": kwargs,
        "kv_pool": pool,
        "runs": [
            dict(r.as_dict(), speedup_vs_reserve=r.tok_per_s / base.tok_per_s if base.tok_per_s else None) for r in runs
        ],
        "ok": all(r.ok for r in runs),
    }
    write_report(report, opts.output, print_fn)
    return report
