"""`kvledger bench --workload nano-vllm`: nano-vllm's offline throughput benchmark on this engine.

The workload is the one nano-vllm publishes (its bench.py): `random.seed(0)`, 256 requests, prompts of
`randint(100, 1024)` token ids drawn with `randint(0, 10000)` (first loop), then one
`max_tokens = randint(100, 1024)` per request (second loop); greedy, EOS ignored. That is exactly
142,827 input and 133,966 output tokens. `--num-requests`, `--max-input-len` and `--max-output-len`
scale it down (the lower length bounds scale with the upper ones) for smoke runs on the CPU.

It runs on this engine (random weights of a shipped config, or `--model` for real weights) and,
with `--compare transformers`, on transformers' continuous batching with the same model shape and
dtype, each request with its own `max_new_tokens`. Throughput is output tokens over wall time
(prefill included); each system first runs a few warm-up requests, outside the timing.

Besides the table it prints:

* the memory-bandwidth floor (`engine/bench_floor.py`): the bytes decode must read if all requests
  decode together from the first step (every step reads the weights once, and every running
  request's KV context), over a bandwidth measured in the same run with a device-to-device copy;
* a profiler breakdown of decode steps (`engine/bench_profile.py`; a second, decode-heavy batch
  under torch.profiler): GPU kernel time by kind (attention, GEMM, sampling, other) and the host's
  `kvledger.*` ranges.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from kvledger.bench.arguments import NANO_MAX_LEN, NANO_MIN_LEN, NANO_NUM_REQUESTS, WORKLOAD
from kvledger.bench.engine import quiet_transformers
from kvledger.bench.bandwidth_floor import decode_floor, format_floor, measure_bandwidth, param_count
from kvledger.bench.decode_profile import format_breakdown, profile_decode, sync
from kvledger.engine.model.config import BUILTIN_CONFIG_DIR, ModelConfig
from kvledger.engine.engine_config import EngineConfig

ENGINE_ROW = "kvledger"
HF_ROW = "transformers continuous batching"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# nano-vllm's bench.py
NANO_VOCAB_MAX = 10000  # randint(0, 10000): inclusive, so the model needs a vocabulary of at least 10,001



# ------------------------------------------------------------------------------------ workload


@dataclass
class NanoWorkload:
    prompts: List[List[int]]
    max_tokens: List[int]
    seed: int = 0

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def describe(self) -> Dict[str, Any]:
        lens = [len(p) for p in self.prompts]
        return {
            "name": WORKLOAD, "num_requests": len(self.prompts), "seed": self.seed,
            "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
            "input_len_range": [min(lens), max(lens)] if lens else [0, 0],
            "output_len_range": [min(self.max_tokens), max(self.max_tokens)] if lens else [0, 0],
        }


def scaled_min_len(max_len: int) -> int:
    """nano-vllm's lower length bound (100 of 1024), scaled with the upper bound."""
    return max(1, min(max_len, round(NANO_MIN_LEN * max_len / NANO_MAX_LEN)))


def make_nano_workload(
    num_requests: int = NANO_NUM_REQUESTS,
    max_input_len: int = NANO_MAX_LEN,
    max_output_len: int = NANO_MAX_LEN,
    seed: int = 0,
    min_input_len: Optional[int] = None,
    min_output_len: Optional[int] = None,
) -> NanoWorkload:
    """nano-vllm's workload, drawn in nano-vllm's order (all prompts, then all max_tokens)."""
    lo_in = scaled_min_len(max_input_len) if min_input_len is None else min_input_len
    lo_out = scaled_min_len(max_output_len) if min_output_len is None else min_output_len
    if num_requests < 1 or not 1 <= lo_in <= max_input_len or not 1 <= lo_out <= max_output_len:
        raise ValueError(f"bad workload shape: {num_requests=} input {lo_in}-{max_input_len} output {lo_out}-{max_output_len}")
    rng = random.Random(seed)  # the same stream as random.seed(seed) + the module-level randint
    prompts = [[rng.randint(0, NANO_VOCAB_MAX) for _ in range(rng.randint(lo_in, max_input_len))]
               for _ in range(num_requests)]
    max_tokens = [rng.randint(lo_out, max_output_len) for _ in range(num_requests)]
    return NanoWorkload(prompts, max_tokens, seed)


def warmup_requests(max_input_len: int, n: int = 8, seed: int = 0) -> tuple[List[List[int]], List[int]]:
    """A few short requests of varied lengths, not prefixes of the workload (no prefix-cache hits)."""
    rng = random.Random(f"warmup-{seed}")
    top = max(1, min(max_input_len, 256))
    prompts = [[rng.randint(0, NANO_VOCAB_MAX) for _ in range(rng.randint(max(1, top // 8), top))] for _ in range(n)]
    return prompts, [8] * n


# ------------------------------------------------------------------------------------ model config


def resolve_model_config(name_or_path: str) -> tuple[ModelConfig, Dict[str, Any], Path]:
    """A shipped config name ("qwen3-0.6b", "smollm2-135m"), a config .json, or a directory holding one."""
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "config.json"
    elif p.suffix != ".json":
        p = BUILTIN_CONFIG_DIR / f"{name_or_path}.json"
    if not p.is_file():
        shipped = sorted(f.stem for f in BUILTIN_CONFIG_DIR.glob("*.json"))
        raise FileNotFoundError(f"no model config {name_or_path!r} (shipped: {', '.join(shipped)}, or a config .json)")
    hf = json.loads(p.read_text())
    return ModelConfig.from_hf_config(hf), hf, p


# ------------------------------------------------------------------------------------ the floor


# ------------------------------------------------------------------------------------ systems


@dataclass
class SystemRun:
    name: str
    input_tokens: int
    output_tokens: int  # tokens actually generated
    expected_output_tokens: int
    seconds: float
    mismatched_requests: int = 0  # requests that did not produce exactly their max_tokens
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("inf")

    @property
    def ok(self) -> bool:
        return self.mismatched_requests == 0 and self.output_tokens == self.expected_output_tokens

    def as_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "expected_output_tokens": self.expected_output_tokens, "seconds": self.seconds,
                "tok_per_s": self.tok_per_s, "token_counts_ok": self.ok,
                "mismatched_requests": self.mismatched_requests, **self.extra}


def _free_memory(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _pages(tokens: int, page: int) -> int:
    return -(-tokens // page)


def kv_tokens_for(prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], page: int) -> int:
    """KV tokens for every request to run at once, whole pages each (one spare token per request)."""
    return sum(_pages(len(p) + m + 1, page) * page for p, m in zip(prompts, max_tokens))


def build_engine(opts: "NanoOptions", kv_tokens_needed: int, max_seq_len: int):
    """This engine's LLM. The KV pool: as asked, else sized from free memory on CUDA, else just
    what the workload needs with every request running at once."""
    from kvledger.engine.runtime.llm import LLM

    cuda = torch.device(opts.device).type == "cuda"
    kv_tokens = opts.kv_cache_tokens if opts.kv_cache_tokens is not None else (None if cuda else kv_tokens_needed)
    kw: Dict[str, Any] = dict(dummy_weights=opts.model is None, device=opts.device, dtype=opts.dtype,
                              page_size=opts.page_size, max_running_reqs=opts.max_running_reqs,
                              max_seq_len=max_seq_len, max_prefill_tokens=opts.max_prefill_tokens, seed=opts.seed,
                              kv_cache_tokens=kv_tokens, cuda_graphs=opts.cuda_graphs, overlap=opts.overlap,
                              attention=opts.attention, threads=opts.threads,
                              tensor_parallel_size=opts.tensor_parallel_size, kv_cache_dtype=opts.kv_cache_dtype)
    source = opts.model if opts.model is not None else str(opts.model_config_path)
    return LLM(source, **kw), kw


def run_engine(llm, workload: NanoWorkload, warmup: tuple[List[List[int]], List[int]], device: str) -> SystemRun:
    from kvledger.fast import SamplingParams

    def params(ms: Sequence[int]) -> List[Any]:
        return [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m) for m in ms]

    wp, wm = warmup
    for o in llm.generate(wp, params(wm), use_tqdm=False):
        if o.error is not None:
            raise o.error
    sync(device)
    sched = llm.scheduler
    host0, steps0 = dict(sched.host_seconds), dict(sched.steps)
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, params(workload.max_tokens), use_tqdm=False)
    sync(device)
    seconds = time.perf_counter() - start
    for o in outs:
        if o.error is not None:
            raise o.error
    bad = sum(len(o.token_ids) != m for o, m in zip(outs, workload.max_tokens))
    extra: Dict[str, Any] = {  # the scheduler's own counters: host seconds per part of a step, steps per phase
        "host_seconds": {k: v - host0[k] for k, v in sched.host_seconds.items()},
        "steps": {k: v - steps0[k] for k, v in sched.steps.items()},
    }
    return SystemRun(ENGINE_ROW, workload.input_tokens, sum(len(o.token_ids) for o in outs), workload.output_tokens,
                     seconds, bad, extra=extra)


def _accepted(fn: Callable, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The kwargs fn's signature names (transformers' continuous batching API moves between releases)."""
    names = {n for n, p in inspect.signature(fn).parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    return {k: v for k, v in kwargs.items() if k in names}


def make_cb_config(**wanted: Any):
    """transformers' ContinuousBatchingConfig with the fields this release has (page_size was block_size)."""
    try:
        from transformers.generation import ContinuousBatchingConfig
    except ImportError:  # pragma: no cover - older layouts
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    names = set(inspect.signature(ContinuousBatchingConfig).parameters)
    if "page_size" in wanted and "page_size" not in names and "block_size" in names:
        wanted["block_size"] = wanted.pop("page_size")
    return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in names})


def build_hf_model(opts: "NanoOptions"):
    """transformers' model: random weights from the same config.json (or --model's real weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with quiet_transformers(hide_stderr=False):
        if opts.model is not None:
            from kvledger.bench.engine import load_hf_model

            model = load_hf_model(opts.dtype, opts.model, attn_implementation=opts.hf_attn)
            return model.to(opts.device).eval()
        cfg = dict(opts.hf_config)
        cfg.pop("torch_dtype", None)
        cfg.pop("dtype", None)
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        with torch.device(opts.device):
            model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[opts.dtype],
                                                     attn_implementation=opts.hf_attn)
        return model.to(opts.device).eval()


def _collect(manager, ids: Sequence[str], timeout_s: float) -> Dict[str, Any]:
    pending, done = set(ids), {}
    deadline = time.monotonic() + timeout_s
    while pending:
        r = manager.get_result(timeout=1)
        if r is None:
            if not manager.is_running():
                raise RuntimeError(f"transformers' generation loop stopped with {len(pending)} requests unfinished")
            if time.monotonic() > deadline:
                raise TimeoutError(f"transformers: {len(pending)} requests unfinished after {timeout_s:.0f} s")
            continue
        if r.request_id in pending and r.is_finished():
            if r.error:
                raise RuntimeError(f"transformers request {r.request_id} failed: {r.error}")
            pending.discard(r.request_id)
            done[r.request_id] = r
    return done


@torch.no_grad()
def run_transformers(model, workload: NanoWorkload, warmup: tuple[List[List[int]], List[int]],
                     opts: "NanoOptions") -> SystemRun:
    """transformers continuous batching, each request with its own max_new_tokens (add_request)."""
    from transformers import GenerationConfig

    cuda = torch.device(opts.device).type == "cuda"
    longest = max(workload.max_tokens)
    gen = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=-1, pad_token_id=0)
    if cuda:
        # transformers' own choices on a GPU: cache from free memory, batch budget, CUDA graphs, flash if installed
        cb = make_cb_config(max_batch_tokens=opts.hf_max_batch_tokens) if opts.hf_max_batch_tokens else make_cb_config()
    else:
        # size the paged cache for the workload: left to itself it sizes from free memory and takes gigabytes
        page = 64
        blocks = sum(_pages(len(p) + m, page) for p, m in zip(workload.prompts, workload.max_tokens))
        blocks += sum(_pages(len(p) + m, page) for p, m in zip(*warmup)) + 2
        cb = make_cb_config(page_size=page, num_blocks=blocks, max_batch_tokens=opts.hf_max_batch_tokens or 2048,
                            auto_switch_to_flash=False)
    cm_kwargs: Dict[str, Any] = dict(generation_config=gen, continuous_batching_config=cb, block=True, timeout=60,
                                     warmup=cuda)
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        cm_kwargs["workload_hints"] = WorkloadHints(
            max_prompt_length=max(len(p) for p in workload.prompts), max_generated_length=longest,
            num_requests=len(workload.prompts))
    except ImportError:  # pragma: no cover - releases without hints
        pass
    cm_kwargs = _accepted(model.continuous_batching_context_manager, cm_kwargs)

    def submit(manager, prompts, max_tokens, prefix: str) -> List[str]:
        ids = []
        for i, (p, m) in enumerate(zip(prompts, max_tokens)):
            rid = f"{prefix}{i}"
            got = manager.add_request(input_ids=list(p), request_id=rid, max_new_tokens=m, eos_token_id=-1)
            if got is None and not manager.is_running():
                raise RuntimeError("transformers' manager refused a request")
            ids.append(rid)
        return ids

    timeout_s = 3600.0
    with quiet_transformers(hide_stderr=False), model.continuous_batching_context_manager(**cm_kwargs) as manager:
        _collect(manager, submit(manager, warmup[0], warmup[1], "warmup_"), timeout_s)  # same manager, warm
        sync(opts.device)
        start = time.perf_counter()
        ids = submit(manager, workload.prompts, workload.max_tokens, "req_")
        results = _collect(manager, ids, timeout_s)
        sync(opts.device)
        seconds = time.perf_counter() - start
        attn = getattr(model.config, "_attn_implementation", None)
    lens = [len(results[rid].generated_tokens) for rid in ids]
    bad = sum(n != m for n, m in zip(lens, workload.max_tokens))
    return SystemRun(HF_ROW, workload.input_tokens, sum(lens), workload.output_tokens, seconds, bad,
                     {"attn_implementation": attn})


# ------------------------------------------------------------------------------------ profile
# ------------------------------------------------------------------------------------ report


def format_host_line(name: str, seconds: float, steps: Dict[str, int], host: Dict[str, float]) -> str:
    """Steps by phase, wall ms per step, and the scheduler's host seconds per step by part."""
    n = max(1, sum(steps.values()))
    parts = ", ".join(f"{k} {1000 * v / n:.3f}" for k, v in host.items())
    return (f"{name} steps: {steps.get('prefill', 0):,} prefill + {steps.get('decode', 0):,} decode, "
            f"{1000 * seconds / n:.3f} ms per step; host ms per step: {parts} "
            f"(land includes wait, the host blocked on the GPU)")


def format_table(runs: Sequence[SystemRun]) -> List[str]:
    ours = next((r for r in runs if r.name.startswith(ENGINE_ROW)), None)
    header = (f"{'system':<34} {'input tokens':>12} {'output tokens':>13} {'time (s)':>9} "
              f"{'throughput (tok/s)':>18} {'ours/this':>9}")
    lines = [header, "-" * len(header)]
    for r in runs:
        ratio = ours.tok_per_s / r.tok_per_s if ours and r.tok_per_s else float("nan")
        lines.append(f"{r.name:<34} {r.input_tokens:>12,} {r.output_tokens:>13,} {r.seconds:>9.2f} "
                     f"{r.tok_per_s:>18,.1f} {ratio:>8.2f}x")
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


@dataclass
class NanoOptions:
    model_config: str = "qwen3-0.6b"
    model: Optional[str] = None  # real weights (GGUF or HF directory) instead of random ones
    device: Optional[str] = None  # default: cuda if available
    dtype: Optional[str] = None  # default: bfloat16 on CUDA, float32 on CPU
    num_requests: int = NANO_NUM_REQUESTS
    max_input_len: int = NANO_MAX_LEN
    max_output_len: int = NANO_MAX_LEN
    seed: int = 0
    compare: str = "none"
    page_size: int = EngineConfig.page_size
    kv_cache_dtype: str = EngineConfig.kv_cache_dtype
    kv_cache_tokens: Optional[int] = None
    max_running_reqs: int = 256
    max_prefill_tokens: int = 16384
    cuda_graphs: Optional[bool] = None  # default: on CUDA only
    overlap: Optional[bool] = None
    attention: str = EngineConfig.attention
    threads: Optional[int] = None
    tensor_parallel_sizes: str = "1"  # comma-separated: each size runs the workload in turn
    tensor_parallel_size: int = 1  # the size being run
    hf_attn: str = "sdpa"
    hf_max_batch_tokens: Optional[int] = None
    bandwidth_bytes: Optional[int] = None  # default: 2 GiB on CUDA, 64 MiB on CPU
    bandwidth_gbs: Optional[float] = None  # use this instead of measuring
    profile_requests: int = 256
    profile_output_len: int = 32
    warmup_requests: int = 8
    output: Optional[str] = None  # write the report here as JSON
    # resolved
    model_config_path: Optional[Path] = None
    hf_config: Dict[str, Any] = field(default_factory=dict)

    def resolve(self) -> "NanoOptions":
        self.device, self.dtype = default_device_and_dtype(self.device, self.dtype)
        cuda = torch.device(self.device).type == "cuda"
        if self.cuda_graphs is None:
            self.cuda_graphs = cuda
        if self.bandwidth_bytes is None:
            self.bandwidth_bytes = (2 << 30) if cuda else (64 << 20)
        sizes = self.tp_sizes()
        if not sizes or any(n < 1 for n in sizes):
            raise ValueError(f"--tp must list sizes >= 1, comma-separated, got {self.tensor_parallel_sizes!r}")
        if self.compare not in ("none", "transformers"):
            raise ValueError(f"compare must be 'none' or 'transformers', got {self.compare!r}")
        return self


    def tp_sizes(self) -> List[int]:
        try:
            return [int(x) for x in str(self.tensor_parallel_sizes).split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--tp must list integers, comma-separated, got {self.tensor_parallel_sizes!r}") from None


def default_device_and_dtype(device: Optional[str], dtype: Optional[str]) -> tuple[str, str]:
    """The benchmarks' defaults: cuda when there is one; bfloat16 there, float32 on the CPU."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return device, dtype


def _versions() -> Dict[str, Optional[str]]:
    try:
        import transformers

        tv: Optional[str] = transformers.__version__
    except ImportError:
        tv = None
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": tv,
            "cuda": torch.version.cuda}


def _device_name(device: str) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} torch threads)"


def run_nano_bench(opts: NanoOptions, print_fn: Callable[[str], None] = print) -> Dict[str, Any]:
    """Run the workload (and transformers with --compare), print everything; returns the raw numbers."""
    opts.resolve()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    cuda = torch.device(opts.device).type == "cuda"
    workload = make_nano_workload(opts.num_requests, opts.max_input_len, opts.max_output_len, opts.seed)
    warm = warmup_requests(opts.max_input_len, min(opts.warmup_requests, opts.num_requests), opts.seed)
    k = min(opts.profile_requests, len(workload.prompts))
    prof_prompts = workload.prompts[:k]
    prof_tokens = [opts.profile_output_len] * k

    if opts.model is None:
        config, hf_config, path = resolve_model_config(opts.model_config)
        opts.model_config_path, opts.hf_config = path, hf_config
    d = workload.describe()
    print_fn(f"workload {WORKLOAD}: {d['num_requests']} requests, input {d['input_len_range'][0]}-"
             f"{d['input_len_range'][1]} tokens ({d['input_tokens']:,} total), output {d['output_len_range'][0]}-"
             f"{d['output_len_range'][1]} tokens ({d['output_tokens']:,} total), greedy, ignore EOS, seed {opts.seed}")

    # bandwidth first, while the device memory is free
    if opts.bandwidth_gbs:
        bandwidth = {"source": "given", "method": "--bandwidth-gbs", "bytes_per_s": opts.bandwidth_gbs * 1e9}
    else:
        bandwidth = measure_bandwidth(opts.device, opts.bandwidth_bytes)

    page = opts.page_size
    longest = max(len(p) + m for p, m in zip(workload.prompts + warm[0] + prof_prompts,
                                                workload.max_tokens + warm[1] + prof_tokens))
    max_seq_len = _pages(max(longest, opts.max_input_len + opts.max_output_len) + 1, page) * page
    need = max(kv_tokens_for(workload.prompts, workload.max_tokens, page), kv_tokens_for(*warm, page),
               kv_tokens_for(prof_prompts, prof_tokens, page))
    runs: List[SystemRun] = []
    breakdowns: Dict[int, Any] = {}
    sizes = opts.tp_sizes()
    for size in sizes:
        opts.tensor_parallel_size = size
        llm, engine_kwargs = build_engine(opts, need, max_seq_len)
        try:
            config = llm.config
            model_desc = opts.model if opts.model is not None else f"{opts.model_config} (random weights)"
            if not runs:
                print_fn(f"model {model_desc}: {param_count(config):,} params, {opts.dtype} on {opts.device} "
                         f"({_device_name(opts.device)}); torch {torch.__version__}, transformers "
                         f"{_versions()['transformers']}")
            run = run_engine(llm, workload, warm, opts.device)
            if len(sizes) > 1:
                run.name = f"{ENGINE_ROW} tp={size}"
            run.extra["tensor_parallel_size"] = size
            run.extra["kv_pool_tokens"] = llm.scheduler.config.num_pages * llm.scheduler.config.page_size
            runs.append(run)
            if k and opts.profile_output_len > 1:  # rank 0's GPU: its kernels and its all-reduces
                breakdowns[size] = profile_decode(llm, prof_prompts, prof_tokens, opts.device)
        finally:
            llm.close()
            del llm
            _free_memory(opts.device)
    breakdown = breakdowns.get(sizes[0])

    if opts.compare == "transformers":
        hf = build_hf_model(opts)
        try:
            runs.append(run_transformers(hf, workload, warm, opts))
        finally:
            del hf
            _free_memory(opts.device)

    itemsize = DTYPES[opts.dtype].itemsize
    floor = decode_floor(config, itemsize, [len(p) for p in workload.prompts], workload.max_tokens,
                         bandwidth["bytes_per_s"])
    for line in format_table(runs):
        print_fn(line)
    for line in format_floor(floor, bandwidth, runs[0].seconds):
        print_fn(line)
    fp8_floor = None
    if opts.kv_cache_dtype == "fp8_e4m3":  # the cache stores 1 byte per value: the floor moves
        fp8_floor = decode_floor(config, itemsize, [len(p) for p in workload.prompts], workload.max_tokens,
                                 bandwidth["bytes_per_s"], kv_itemsize=1)
        print_fn("with the FP8 KV cache (1 byte per K/V value):")
        for line in format_floor(fp8_floor, bandwidth, runs[0].seconds):
            print_fn(line)
    for size, b in breakdowns.items():
        if len(sizes) > 1:
            print_fn(f"tensor-parallel size {size} (rank 0):")
        for line in format_breakdown(b):
            print_fn(line)

    opts_dict = {k2: (str(v) if isinstance(v, Path) else v) for k2, v in asdict(opts).items() if k2 != "hf_config"}
    report = {
        "workload": d,
        "options": opts_dict,
        "model": {"source": model_desc, "config": asdict(config), "params": param_count(config)},
        "dtype": opts.dtype,
        "device": opts.device,
        "device_name": _device_name(opts.device),
        "versions": _versions(),
        "engine_kwargs": engine_kwargs,
        "systems": [r.as_dict() for r in runs],
        "ratio_ours_over_transformers": (runs[0].tok_per_s / runs[1].tok_per_s) if len(runs) > 1 else None,
        "bandwidth": bandwidth,
        "floor": {**floor, "fraction_of_floor_reached": floor["seconds"] / runs[0].seconds if runs[0].seconds else None},
        "fp8_kv_floor": fp8_floor,
        "breakdown": breakdown,
        "breakdown_per_tp_size": breakdowns,
        "ok": all(r.ok for r in runs),
    }
    if opts.output:
        Path(opts.output).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print_fn(f"wrote {opts.output}")
    if cuda:
        _free_memory(opts.device)
    return report


# ------------------------------------------------------------------------------------ command line


def options_from_args(args) -> NanoOptions:
    names = {f for f in NanoOptions.__dataclass_fields__ if f not in ("model_config_path", "hf_config")}
    return NanoOptions(**{n: getattr(args, n) for n in names if hasattr(args, n)})  # overlap: None/True/False


def main_nano_bench(args) -> int:
    try:
        report = run_nano_bench(options_from_args(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"kvledger bench --workload {WORKLOAD}: {e}", file=sys.stderr)
        return 2
    return 0 if report["ok"] else 1
