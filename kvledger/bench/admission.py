"""`kvledger bench --workload early-stop`: reserve vs optimistic admission when the scheduler does not
know how long each output will be.

The workload (`make_early_stop_workload`, drawn from `random.Random(seed)` alone, in this order):
`--num-requests` prompts of uniform length in [100/1024 of `--max-input-len`, `--max-input-len`]
(nano-vllm's bounds), token ids uniform in [0, 10000]; then one output length per request from a
lognormal, `round(exp(N(ln median, sigma)))`, clamped to [1, max_tokens]. Defaults: on CUDA 256
requests, prompts 100-1024 (nano-vllm's very prompts), max_tokens 2048, median 200 and sigma 1.0
(a distribution of mean 330 and p90 720, 1% at the cap: the long-tailed shape of chat answers,
e.g. ShareGPT's; seed 0 draws mean 280, median 164, p90 616, two at 2048); on the CPU 24
requests, prompts 12-128, max_tokens 256 and the median scaled with max_tokens (25), same sigma.

Every request asks `max_tokens` (greedy, EOS ignored), so that is all the scheduler knows. The
bench drives `llm.scheduler` itself: it counts the tokens each request delivers and aborts the
request as soon as its count reaches its drawn length, as an EOS would end it (an abort releases
the request's KV to the prefix cache, like a finish). A request drawn at max_tokens ends by length.

The KV pool is the same for every run and limits concurrency: by default it holds
ceil(min(max_running_reqs, requests) / 8) worst cases (the longest prompt plus max_tokens, whole
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

import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from kvledger.bench.arguments import EARLY_STOP, EARLY_STOP_RATIOS
from kvledger.bench.bandwidth_floor import param_count
from kvledger.bench.decode_profile import sync
from kvledger.bench.nano import DTYPES, NANO_VOCAB_MAX, _device_name, _free_memory, _pages, _versions, \
    resolve_model_config, scaled_min_len, warmup_requests
from kvledger.engine.engine_config import EngineConfig
from kvledger.engine.options import ADMISSION_POLICIES

# defaults on CUDA, and on the CPU (where the three runs take a few minutes)
CUDA_DEFAULTS = {"num_requests": 256, "max_input_len": 1024, "max_tokens": 2048}
CPU_DEFAULTS = {"num_requests": 24, "max_input_len": 128, "max_tokens": 256}
MEDIAN_PER_MAX_TOKENS = 200 / 2048  # the default median output length, as a fraction of max_tokens
POOL_DIVISOR = 8  # the default pool holds this fraction (1/8) of the concurrent requests' worst cases
WARMUP = {"cuda": (8, 8), "cpu": (1, 2)}  # warm-up requests and their max_tokens


# ------------------------------------------------------------------------------------ workload


@dataclass
class EarlyStopWorkload:
    prompts: List[List[int]]
    max_tokens: int  # what every request asks, and all the scheduler knows
    output_lens: List[int]  # where the bench ends each request
    output_median: float
    output_sigma: float
    seed: int = 0

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self) -> Dict[str, Any]:
        lens, outs = [len(p) for p in self.prompts], sorted(self.output_lens)
        return {
            "name": EARLY_STOP, "num_requests": len(self.prompts), "seed": self.seed,
            "input_tokens": self.input_tokens, "input_len_range": [min(lens), max(lens)],
            "max_tokens": self.max_tokens,
            "output_distribution": {"kind": "lognormal", "median": self.output_median, "sigma": self.output_sigma,
                                    "clamp": [1, self.max_tokens]},
            "output_tokens": self.output_tokens,
            "output_len_mean": statistics.fmean(outs), "output_len_median": statistics.median(outs),
            "output_len_p90": percentile(outs, 0.9), "output_len_max": outs[-1],
            "requests_at_max_tokens": sum(n == self.max_tokens for n in outs),
            "output_fraction_of_max_tokens": self.output_tokens / (self.max_tokens * len(outs)),
            "prompt_lens": lens, "output_lens": list(self.output_lens),
        }


def percentile(sorted_values: Sequence[int], q: float) -> int:
    """The nearest-rank percentile (a value that occurs) of sorted values."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def draw_output_len(rng: random.Random, median: float, sigma: float, max_tokens: int) -> int:
    return max(1, min(max_tokens, round(rng.lognormvariate(math.log(median), sigma))))


def make_early_stop_workload(num_requests: int, max_input_len: int, max_tokens: int, output_median: float,
                             output_sigma: float = 1.0, seed: int = 0,
                             min_input_len: Optional[int] = None) -> EarlyStopWorkload:
    lo = scaled_min_len(max_input_len) if min_input_len is None else min_input_len
    if num_requests < 1 or not 1 <= lo <= max_input_len or max_tokens < 1:
        raise ValueError(f"bad workload shape: {num_requests=} input {lo}-{max_input_len} {max_tokens=}")
    if output_median <= 0 or output_sigma < 0:
        raise ValueError(f"the output lengths need a median > 0 and a sigma >= 0, got {output_median}, {output_sigma}")
    rng = random.Random(seed)
    prompts = [[rng.randint(0, NANO_VOCAB_MAX) for _ in range(rng.randint(lo, max_input_len))]
               for _ in range(num_requests)]
    lens = [draw_output_len(rng, output_median, output_sigma, max_tokens) for _ in range(num_requests)]
    return EarlyStopWorkload(prompts, max_tokens, lens, output_median, output_sigma, seed)


def worst_case_tokens(workload: EarlyStopWorkload, page_size: int) -> int:
    """KV of the longest request at its worst case (longest prompt plus max_tokens), whole pages."""
    return _pages(max(len(p) for p in workload.prompts) + workload.max_tokens, page_size) * page_size


def default_kv_cache_tokens(workload: EarlyStopWorkload, max_running_reqs: int, page_size: int) -> int:
    """Room for ceil(min(max_running_reqs, requests) / 8) worst cases: reserve runs about an eighth of
    the requests that could run at once."""
    cases = max(1, -(-min(max_running_reqs, len(workload.prompts)) // POOL_DIVISOR))
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
        d.update(tok_per_s=self.tok_per_s, mean_batch=self.mean_batch, recomputed_fraction=self.recomputed_fraction,
                 token_counts_ok=self.ok)
        return d


@dataclass
class _Batches:
    """Decode batch sizes, from the cache scheduler's after_forward hook (the batch that ran)."""

    decode_steps: int = 0
    prefill_steps: int = 0
    batch_sum: int = 0
    peak: int = 0

    def __call__(self, phase: str, batch: List[Any]) -> None:
        if phase == "decode":
            self.decode_steps += 1
            self.batch_sum += len(batch)
            self.peak = max(self.peak, len(batch))
        else:
            self.prefill_steps += 1


def drive(sched, prompts: Sequence[Sequence[int]], max_tokens: int, targets: Sequence[int],
          first_uid: int) -> Tuple[Dict[int, int], Dict[int, str], int, float]:
    """Submit every request (greedy, EOS ignored, max_tokens each), step the scheduler until it is
    idle, and abort each request once it has delivered its target count, unless the engine ends it
    (at max_tokens). Returns tokens delivered per uid, failures per uid, how many were aborted, and
    the seconds the aborts took."""
    from kvledger.fast import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    uids = list(range(first_uid, first_uid + len(prompts)))
    for uid, prompt in zip(uids, prompts):
        sched.submit(uid, prompt, params)
    target = dict(zip(uids, targets))
    delivered = dict.fromkeys(uids, 0)
    errors: Dict[int, str] = {}
    live = set(uids)
    aborted, abort_seconds = 0, 0.0
    while sched.has_work:
        for ev in sched.step():
            if ev.error is not None:
                errors[ev.uid] = ev.error
                live.discard(ev.uid)
                continue
            delivered[ev.uid] += 1  # a token after the end would show as a mismatch
            if ev.finished:
                live.discard(ev.uid)
            elif ev.uid in live and delivered[ev.uid] >= target[ev.uid]:
                t = time.perf_counter()
                sched.abort(ev.uid)  # the bench's EOS: the scheduler learns the end only now
                abort_seconds += time.perf_counter() - t
                live.discard(ev.uid)
                aborted += 1
    return delivered, errors, aborted, abort_seconds


def run_policy(llm, workload: EarlyStopWorkload, policy: str, ratio: Optional[float],
               warmup: Tuple[List[List[int]], int], device: str) -> PolicyRun:
    sched = llm.scheduler
    wp, wmax = warmup
    if wp:
        _, errors, _, _ = drive(sched, wp, wmax, [wmax] * len(wp), 0)
        if errors:
            raise RuntimeError(f"warm-up requests failed: {errors}")
    driver = sched.driver
    driver.forget_observed_outputs()  # adaptive: what the warm-up generated is not the workload's
    batches = _Batches()
    driver.after_forward = batches
    pre0, rec0, host0 = driver.preemptions, driver.recomputed_tokens, dict(sched.host_seconds)
    sync(device)
    start = time.perf_counter()
    delivered, errors, aborted, abort_seconds = drive(sched, workload.prompts, workload.max_tokens,
                                                      workload.output_lens, len(wp))
    sync(device)
    seconds = time.perf_counter() - start
    driver.after_forward = None
    got = list(delivered.values())
    bad = sum(n != want for n, want in zip(got, workload.output_lens))
    return PolicyRun(policy, ratio, sum(got), workload.output_tokens, seconds, bad, errors, batches.decode_steps,
                     batches.prefill_steps, batches.batch_sum, batches.peak, driver.preemptions - pre0,
                     driver.recomputed_tokens - rec0, aborted, len(got) - aborted - len(errors),
                     {**{k: v - host0.get(k, 0.0) for k, v in sched.host_seconds.items()}, "abort": abort_seconds})


# ------------------------------------------------------------------------------------ options


@dataclass
class EarlyStopOptions:
    device: Optional[str] = None  # default: cuda if available
    dtype: Optional[str] = None  # default: bfloat16 on CUDA, float32 on the CPU
    model: Optional[str] = None  # real weights (GGUF or HF directory)
    model_config: Optional[str] = None  # random weights of this config (default: qwen3-0.6b on CUDA, the
    # embedded model on the CPU)
    num_requests: Optional[int] = None
    max_input_len: Optional[int] = None
    max_tokens: Optional[int] = None
    output_median: Optional[float] = None
    output_sigma: float = 1.0
    seed: int = 0
    policies: str = "reserve,optimistic"
    ratios: str = EARLY_STOP_RATIOS
    page_size: int = EngineConfig.page_size
    kv_cache_tokens: Optional[int] = None
    max_running_reqs: int = 256
    max_prefill_tokens: int = 16384
    cuda_graphs: Optional[bool] = None  # default: on CUDA only
    overlap: Optional[bool] = None
    attention: str = EngineConfig.attention
    threads: Optional[int] = None
    output: Optional[str] = None  # write the report here as JSON

    def resolve(self) -> "EarlyStopOptions":
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        cuda = torch.device(self.device).type == "cuda"
        if self.dtype is None:
            self.dtype = "bfloat16" if cuda else "float32"
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name, value in (CUDA_DEFAULTS if cuda else CPU_DEFAULTS).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.output_median is None:
            self.output_median = self.max_tokens * MEDIAN_PER_MAX_TOKENS
        if self.model is None and self.model_config is None and cuda:
            self.model_config = "qwen3-0.6b"
        if self.cuda_graphs is None:
            self.cuda_graphs = cuda
        self.run_list()  # check them now
        return self

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


def options_from_args(args) -> EarlyStopOptions:
    """The early-stop options from `kvledger bench`'s namespace; the options it shares with the
    nano-vllm workload (--num-requests, --max-input-len, --model-config) count only if given."""
    given = getattr(args, "given", frozenset())
    shared = {"num_requests", "max_input_len", "model_config"}
    names = [f for f in EarlyStopOptions.__dataclass_fields__ if hasattr(args, f)]
    return EarlyStopOptions(**{n: getattr(args, n) for n in names if n not in shared or n in given})


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
    header = (f"{'policy':<16} {'output tokens':>13} {'time (s)':>9} {'tok/s':>10} {'mean batch':>10} "
              f"{'peak batch':>10} {'decode steps':>12} {'preemptions':>11} {'recomputed':>10} {'recomp/out':>10} "
              f"{'vs reserve':>10}")
    lines = [header, "-" * len(header)]
    for r in runs:
        speedup = r.tok_per_s / base.tok_per_s if base is not None and base.tok_per_s else float("nan")
        lines.append(f"{r.label:<16} {r.output_tokens:>13,} {r.seconds:>9.2f} {r.tok_per_s:>10,.1f} "
                     f"{r.mean_batch:>10.1f} {r.peak_batch:>10,} {r.decode_steps:>12,} {r.preemptions:>11,} "
                     f"{r.recomputed_tokens:>10,} {100 * r.recomputed_fraction:>9.2f}% {speedup:>9.2f}x")
    for r in runs:
        status = "OK" if r.ok else (f"MISMATCH ({r.mismatched_requests} requests off, {len(r.errors)} failed"
                                    + (f": {next(iter(r.errors.values()))}" if r.errors else "") + ")")
        lines.append(f"token counts {r.label}: {status} ({r.output_tokens:,} of {r.expected_output_tokens:,}; "
                     f"{r.stopped_early} stopped early by the bench, {r.finished_by_length} by max_tokens; "
                     f"{r.prefill_steps:,} prefill steps)")
    for r in runs:
        n = max(1, r.decode_steps + r.prefill_steps)
        parts = ", ".join(f"{k} {1000 * v / n:.2f}" for k, v in r.host_seconds.items())
        lines.append(f"per step {r.label}: {1000 * r.seconds / n:.2f} ms wall; host ms: {parts} (land includes wait, "
                     f"the host blocked on the device)")
    return lines


# ------------------------------------------------------------------------------------ the bench


def _model_source(opts: EarlyStopOptions) -> Tuple[str, bool, str]:
    """(LLM's model argument, dummy weights?, description): --model's real weights, --model-config's
    random ones, else the embedded model."""
    if opts.model is not None:
        return opts.model, False, opts.model
    if opts.model_config is not None:
        return str(resolve_model_config(opts.model_config)[2]), True, f"{opts.model_config} (random weights)"
    from kvledger.engine.model.default_model import default_model_path

    return default_model_path(), False, "the embedded SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)"


def run_early_stop_bench(opts: EarlyStopOptions, print_fn: Callable[[str], None] = print) -> Dict[str, Any]:
    from kvledger.engine.runtime.llm import LLM

    opts.resolve()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    cuda = torch.device(opts.device).type == "cuda"
    workload = make_early_stop_workload(opts.num_requests, opts.max_input_len, opts.max_tokens, opts.output_median,
                                        opts.output_sigma, opts.seed)
    n_warm, warm_tokens = WARMUP["cuda" if cuda else "cpu"]
    warm = (warmup_requests(opts.max_input_len, n_warm, opts.seed)[0], warm_tokens)
    d = workload.describe()
    for line in format_workload(d):
        print_fn(line)

    page = opts.page_size
    worst = worst_case_tokens(workload, page)
    kv_tokens = opts.kv_cache_tokens
    if kv_tokens is None:
        kv_tokens = default_kv_cache_tokens(workload, opts.max_running_reqs, page)
    kv_tokens = kv_tokens // page * page
    if kv_tokens < worst:
        raise ValueError(f"kv_cache_tokens {kv_tokens} is under one request's worst case ({worst} tokens)")
    longest = max(len(p) for p in workload.prompts + warm[0]) + max(workload.max_tokens, warm_tokens)
    source, dummy, model_desc = _model_source(opts)
    engine_kwargs: Dict[str, Any] = dict(
        dummy_weights=dummy, device=opts.device, dtype=opts.dtype, page_size=page, kv_cache_tokens=kv_tokens,
        max_running_reqs=opts.max_running_reqs, max_seq_len=_pages(longest + 1, page) * page,
        max_prefill_tokens=opts.max_prefill_tokens, seed=opts.seed, cuda_graphs=opts.cuda_graphs,
        overlap=opts.overlap, attention=opts.attention, threads=opts.threads)
    mean_prompt = workload.input_tokens / len(workload.prompts)
    pool = {"tokens": kv_tokens, "worst_case_tokens": worst,
            "reserve_fits_worst_cases": kv_tokens // worst,
            "rule": "given" if opts.kv_cache_tokens is not None else
            f"ceil(min(max_running_reqs, requests) / {POOL_DIVISOR}) worst cases (longest prompt + max_tokens)"}
    print_fn(f"KV pool {kv_tokens:,} tokens ({pool['rule']}): {kv_tokens // worst} worst cases of {worst:,} tokens; "
             f"reserve admits about {kv_tokens / (mean_prompt + workload.max_tokens):.1f} requests of a mean prompt at "
             f"once; max_running_reqs {opts.max_running_reqs}, same pool for every run")

    runs: List[PolicyRun] = []
    config = None
    for policy, ratio in opts.run_list():
        kw = dict(engine_kwargs, admission=policy, **({} if ratio is None else {"reserve_ratio": ratio}))
        llm = LLM(source, **kw)
        if config is None:
            config = llm.config
            print_fn(f"model {model_desc}: {param_count(config):,} params, {opts.dtype} on {opts.device} "
                     f"({_device_name(opts.device)}); torch {torch.__version__}")
        try:
            run = run_policy(llm, workload, policy, ratio, warm, opts.device)
        finally:
            del llm
            _free_memory(opts.device)
        runs.append(run)
        print_fn(f"  ran {run.label}: {run.seconds:.2f} s")

    for line in format_table(runs):
        print_fn(line)
    base = runs[0]
    opts_dict = asdict(opts)
    report = {
        "workload": d,
        "options": opts_dict,
        "model": {"source": model_desc, "config": asdict(config), "params": param_count(config)},
        "dtype": opts.dtype,
        "device": opts.device,
        "device_name": _device_name(opts.device),
        "versions": _versions(),
        "engine_kwargs": engine_kwargs,
        "kv_pool": pool,
        "runs": [dict(r.as_dict(), speedup_vs_reserve=r.tok_per_s / base.tok_per_s if base.tok_per_s else None)
                 for r in runs],
        "ok": all(r.ok for r in runs),
    }
    if opts.output:
        Path(opts.output).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print_fn(f"wrote {opts.output}")
    return report


def main_early_stop_bench(args) -> int:
    try:
        report = run_early_stop_bench(options_from_args(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"kvledger bench --workload {EARLY_STOP}: {e}", file=sys.stderr)
        return 2
    return 0 if report["ok"] else 1
