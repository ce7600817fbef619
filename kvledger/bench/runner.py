"""The one runner of the engine benchmarks (`kvledger bench`, `--workload nano-vllm`, `early-stop`,
`shared-prefix`): the options they share, the LLM built from them, and one timed run of a workload
(warm-up first, outside the timing) with the engine's statistics over the run, and the lines and
JSON every benchmark prints and writes.

Two loops drive the engine: `generate_loop`, `LLM.generate` over the whole workload; and
`step_loop`, which steps the engine itself (`Engine.add_request` / `step` / `abort`) and ends each
request at its drawn length, as an EOS would (a workload with `output_lens`). Wall time covers the
loop, prefill included, not model loading; on CUDA the device is synchronized before the clock
starts and before it stops.
"""

from __future__ import annotations

import gc
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from kvledger.bench.decode_profile import sync
from kvledger.bench.workloads import Workload
from kvledger.engine.engine_config import EngineConfig
from kvledger.engine.model.config import BUILTIN_CONFIG_DIR, ModelConfig

ENGINE_ROW = "kvledger"  # this engine's row in the tables
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# LLM's options a benchmark's options may carry; engine_kwargs passes on those they have
ENGINE_OPTIONS = (
    "device",
    "dtype",
    "page_size",
    "kv_cache_dtype",
    "kv_cache_tokens",
    "max_running_req",
    "max_prefill_tokens",
    "seed",
    "cuda_graphs",
    "overlap",
    "attention",
    "fp8_decode_kernel",
    "threads",
    "tensor_parallel_size",
)
PrintFn = Callable[[str], None]


# -- options and the engine -------------------------------------------------------------------------
@dataclass
class BenchOptions:
    """What every `--workload` benchmark takes; each one's options add their own."""

    model_config: Optional[str] = "qwen3-0.6b"  # random weights of this shipped config (or a config.json)
    model: Optional[str] = None  # real weights (GGUF or HF directory) instead of random ones
    device: Optional[str] = None  # default: cuda if available
    dtype: Optional[str] = None  # default: bfloat16 on CUDA, float32 on the CPU
    seed: int = 0
    page_size: int = EngineConfig.page_size
    kv_cache_tokens: Optional[int] = None
    max_running_req: int = 256
    max_prefill_tokens: int = 16384
    cuda_graphs: Optional[bool] = None  # default: on CUDA only
    overlap: Optional[bool] = None
    attention: str = EngineConfig.attention
    fp8_decode_kernel: str = EngineConfig.fp8_decode_kernel
    threads: Optional[int] = None
    output: Optional[str] = None  # write the report here as JSON

    @property
    def cuda(self) -> bool:
        return self.device is not None and torch.device(self.device).type == "cuda"

    def resolve_device(self) -> None:
        """Fill in the device, the dtype and CUDA graphs where they were left to the benchmark."""
        self.device, self.dtype = default_device_and_dtype(self.device, self.dtype)
        if self.cuda_graphs is None:
            self.cuda_graphs = self.cuda

    def resolved(self) -> Tuple[str, str]:
        """(device, dtype), once `resolve_device` has filled them in."""
        if self.device is None or self.dtype is None:
            raise RuntimeError("BenchOptions.resolve_device() has not run")
        return self.device, self.dtype


def default_device_and_dtype(device: Optional[str], dtype: Optional[str]) -> Tuple[str, str]:
    """The benchmarks' defaults: cuda when there is one; bfloat16 there, float32 on the CPU."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return device, dtype


def resolve_model_config(name_or_path: str) -> Tuple[ModelConfig, Dict[str, Any], Path]:
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


def model_source(model: Optional[str], model_config: Optional[str]) -> Tuple[str, bool, str]:
    """(LLM's model argument, dummy weights?, description): `model`'s real weights, `model_config`'s
    random ones, else the embedded model."""
    if model is not None:
        return model, False, model
    if model_config is not None:
        return str(resolve_model_config(model_config)[2]), True, f"{model_config} (random weights)"
    from kvledger.engine.model.default_model import default_model_path

    return default_model_path(), False, "the embedded SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)"


def engine_kwargs(opts: Any, **sized: Any) -> Dict[str, Any]:
    """LLM's keyword arguments: every engine option that `opts` has, then what the benchmark sized
    itself (`sized`: dummy_weights, max_seq_len, kv_cache_tokens, ...). A report shows them."""
    kw = {name: getattr(opts, name) for name in ENGINE_OPTIONS if hasattr(opts, name)}
    kw.update(sized)
    return kw


def build_llm(source: Any, kwargs: Dict[str, Any], **per_run: Any) -> Any:
    """This engine's LLM for one run: the benchmark's kwargs, and what this run changes (a cache, a
    policy)."""
    from kvledger.engine.runtime.llm import LLM

    return LLM(source, **kwargs, **per_run)


def free_memory(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# -- one run ---------------------------------------------------------------------------------------
@dataclass
class EngineStats:
    """The engine's counters: steps per phase, host seconds per part of a step, preemptions and
    recomputed KV tokens (the cache scheduler's)."""

    steps: Dict[str, int] = field(default_factory=dict)
    host_seconds: Dict[str, float] = field(default_factory=dict)
    preemptions: int = 0
    recomputed_tokens: int = 0

    @classmethod
    def of(cls, llm: Any) -> EngineStats:
        engine = llm.engine
        return cls(dict(engine.steps), dict(engine.host_seconds), engine.preemptions, engine.recomputed_tokens)

    def since(self, before: EngineStats) -> EngineStats:
        return EngineStats(
            {k: v - before.steps.get(k, 0) for k, v in self.steps.items()},
            {k: v - before.host_seconds.get(k, 0.0) for k, v in self.host_seconds.items()},
            self.preemptions - before.preemptions,
            self.recomputed_tokens - before.recomputed_tokens,
        )


@dataclass
class DecodeBatches:
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


@dataclass
class LoopResult:
    """What one loop over a workload delivered, per request in the workload's order."""

    outputs: List[List[int]]  # the token ids each request delivered
    cached_tokens: List[int]  # prompt tokens each found in the prefix cache at admission
    errors: Dict[int, str] = field(default_factory=dict)  # uid -> a request's failure (step_loop)
    stopped_early: int = 0  # requests the loop aborted at their drawn length
    abort_seconds: float = 0.0  # what the aborts took


@dataclass
class EngineRun(LoopResult):
    """One timed run of a workload: the loop's result, wall seconds and the engine's statistics."""

    seconds: float = 0.0
    stats: EngineStats = field(default_factory=EngineStats)
    batches: DecodeBatches = field(default_factory=DecodeBatches)

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    def mismatched(self, workload: Workload) -> int:
        """Requests that did not deliver exactly their target (max_tokens, or the drawn length)."""
        return sum(len(o) != t for o, t in zip(self.outputs, workload.targets))


def generate_loop(llm: Any, workload: Workload, first_uid: int = 0) -> LoopResult:
    """`LLM.generate` over the workload (greedy, EOS ignored, each request its max_tokens); a failed
    request raises its error. (LLM numbers the requests itself: `first_uid` is step_loop's.)"""
    from kvledger.fast import SamplingParams

    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m) for m in workload.max_tokens]
    outs = llm.generate(workload.prompts, params, use_tqdm=False)
    for o in outs:
        if o.error is not None:
            raise o.error
    return LoopResult([list(o.token_ids) for o in outs], [o.cached_tokens for o in outs])


def step_loop(llm: Any, workload: Workload, first_uid: int = 0) -> LoopResult:
    """Add every request (greedy, EOS ignored, max_tokens each) to the engine as uids first_uid,
    first_uid + 1, ...; step it until it is idle, and abort each request once it has delivered its
    target (`workload.targets`), unless the engine ends it (at max_tokens)."""
    from kvledger.fast import SamplingParams

    engine = llm.engine
    uids = list(range(first_uid, first_uid + len(workload)))
    for uid, prompt, m in zip(uids, workload.prompts, workload.max_tokens):
        engine.add_request(prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m), uid)
    target = dict(zip(uids, workload.targets))
    delivered: Dict[int, List[int]] = {uid: [] for uid in uids}
    cached = dict.fromkeys(uids, 0)
    errors: Dict[int, str] = {}
    live = set(uids)
    aborted, abort_seconds = 0, 0.0
    while engine.has_work:
        for ev in engine.step():
            cached[ev.uid] = ev.cached_tokens
            if ev.error is not None:
                errors[ev.uid] = ev.error
                live.discard(ev.uid)
                continue
            delivered[ev.uid].append(ev.token)  # a token after the end would show as a mismatch
            if ev.finished:
                live.discard(ev.uid)
            elif ev.uid in live and len(delivered[ev.uid]) >= target[ev.uid]:
                t = time.perf_counter()
                engine.abort(ev.uid)  # the bench's EOS: the engine learns the end only now
                abort_seconds += time.perf_counter() - t
                live.discard(ev.uid)
                aborted += 1
    return LoopResult(list(delivered.values()), list(cached.values()), errors, aborted, abort_seconds)


def run_workload(llm: Any, workload: Workload, warmup: Workload, device: str) -> EngineRun:
    """Warm up (the Triton kernels, CUDA graphs), then run the workload once, timed, with the engine's
    statistics over the run. The step loop drives a workload with output lengths of its own."""
    loop = generate_loop if workload.output_lens is None else step_loop
    if len(warmup):
        warm = loop(llm, warmup)
        if warm.errors:
            raise RuntimeError(f"warm-up requests failed: {warm.errors}")
    cache = llm.engine.cache_scheduler
    cache.forget_observed_outputs()  # adaptive admission: what the warm-up generated is not the workload's
    batches = DecodeBatches()
    cache.after_forward = batches
    before = EngineStats.of(llm)
    try:
        sync(device)
        start = time.perf_counter()
        result = loop(llm, workload, len(warmup))
        sync(device)
        seconds = time.perf_counter() - start
    finally:
        cache.after_forward = None
    stats = EngineStats.of(llm).since(before)
    return EngineRun(**vars(result), seconds=seconds, stats=stats, batches=batches)


# -- results ---------------------------------------------------------------------------------------
@dataclass
class SystemRun:
    """One system's row in a table (this engine, or a transformers baseline)."""

    name: str
    input_tokens: int
    output_tokens: int  # tokens actually generated
    expected_output_tokens: int
    seconds: float
    mismatched_requests: int = 0  # requests that did not produce exactly their max_tokens
    extra: Dict[str, Any] = field(default_factory=dict)
    outputs: Optional[List[List[int]]] = None  # the generated token ids per request, where kept

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("inf")

    @property
    def ok(self) -> bool:
        return self.mismatched_requests == 0 and self.output_tokens == self.expected_output_tokens

    @classmethod
    def of(cls, name: str, run: EngineRun, workload: Workload, **extra: Any) -> SystemRun:
        return cls(
            name,
            workload.input_tokens,
            run.output_tokens,
            workload.output_tokens,
            run.seconds,
            run.mismatched(workload),
            extra,
            run.outputs,
        )

    def as_dict(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "expected_output_tokens": self.expected_output_tokens,
            "seconds": self.seconds,
            "tok_per_s": self.tok_per_s,
            "token_counts_ok": self.ok,
            "mismatched_requests": self.mismatched_requests,
            **self.extra,
        }


def format_host_line(name: str, seconds: float, steps: Dict[str, int], host: Dict[str, float]) -> str:
    """Steps by phase, wall ms per step, and the scheduler's host seconds per step by part."""
    n = max(1, sum(steps.values()))
    parts = ", ".join(f"{k} {1000 * v / n:.3f}" for k, v in host.items())
    return (
        f"{name} steps: {steps.get('prefill', 0):,} prefill + {steps.get('decode', 0):,} decode, "
        f"{1000 * seconds / n:.3f} ms per step; host ms per step: {parts} "
        f"(land includes wait, the host blocked on the GPU)"
    )


def print_lines(lines: Sequence[str], print_fn: PrintFn = print) -> None:
    for line in lines:
        print_fn(line)


def versions() -> Dict[str, Optional[str]]:
    try:
        import transformers

        tv: Optional[str] = transformers.__version__
    except ImportError:
        tv = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": tv,
        "cuda": torch.version.cuda,
    }


def device_name(device: str) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} torch threads)"


def write_report(report: Dict[str, Any], path: Optional[str], print_fn: PrintFn = print) -> None:
    """The report as JSON at `path` (nothing without one), and a line that says so."""
    if path:
        Path(path).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print_fn(f"wrote {path}")
