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

import contextlib
import io
import logging
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ENGINE = "kvledger"
HF_GENERATE = "transformers generate"
HF_BATCH = "transformers generate_batch"
ENGINE_PREFILL_TOKENS = 2048  # the engine's max_prefill_tokens (LLM's default)


@dataclass
class Workload:
    prompts: list[list[int]]
    output_len: int

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def expected_output_tokens(self) -> int:
        return len(self.prompts) * self.output_len


@dataclass
class SystemResult:
    name: str
    outputs: list[list[int]]  # generated token ids, one list per prompt, in prompt order
    seconds: float

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class BenchReport:
    workload: Workload
    dtype: str
    threads: int
    results: list[SystemResult] = field(default_factory=list)

    def result(self, name: str) -> Optional[SystemResult]:
        return next((r for r in self.results if r.name == name), None)


def make_workload(
    num_prompts: int, min_len: int, max_len: int, output_len: int, seed: int = 0, vocab_size: int = 10000
) -> Workload:
    """Seeded random prompts of token ids in [0, vocab_size)."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len=} {max_len=}")
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_prompts)]
    return Workload(prompts, output_len)


# ------------------------------------------------------------------------------------ systems


def run_engine(workload: Workload, dtype: str, model_path: Optional[str] = None) -> SystemResult:
    from kvledger.engine.runtime.llm import LLM
    from kvledger.fast import SamplingParams

    page = 16
    need = sum(-(-(len(p) + workload.output_len) // page) * page for p in workload.prompts)
    llm = LLM(
        model_path,
        dtype=dtype,
        page_size=page,
        kv_cache_tokens=max(need, 4 * page),
        max_running_reqs=max(64, len(workload.prompts)),
        max_prefill_tokens=ENGINE_PREFILL_TOKENS,
        # a multiple of the page size: the scheduler's page table is max_seq_len wide
        max_seq_len=-(-(max(len(p) for p in workload.prompts) + workload.output_len + 1) // page) * page,
    )
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=workload.output_len)
    llm.generate([p[:8] for p in workload.prompts[:2]], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2),
                 use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    for o in outs:
        if o.error is not None:
            raise o.error
    return SystemResult(ENGINE, [list(o.token_ids) for o in outs], seconds)


def load_hf_model(dtype: str, model_path: Optional[str] = None, attn_implementation: str = "sdpa"):
    """transformers' model from the same GGUF the engine uses.

    Dequantizing the GGUF in transformers takes ~20 s here, so the first load saves the float32
    model next to the engine's weight cache and later loads read that copy.
    """
    from transformers import AutoModelForCausalLM

    from kvledger.engine.model.default_model import default_model_path
    from kvledger.engine.model.weights import cache_dir_for

    path = Path(model_path or default_model_path())
    kwargs = dict(dtype=DTYPES[dtype], attn_implementation=attn_implementation)
    with quiet_transformers():
        if path.suffix != ".gguf":
            return AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()
        cached = cache_dir_for(path) / "transformers-float32"
        if not (cached / "config.json").is_file():
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
            # The weights are already dequantized; drop the GGUF marker so save_pretrained accepts them.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".transformers-"))
            try:
                model.save_pretrained(tmp)
                tmp.rename(cached)
            except OSError:  # another process saved it first
                shutil.rmtree(tmp, ignore_errors=True)
            del model
        return AutoModelForCausalLM.from_pretrained(str(cached), **kwargs).eval()


@torch.no_grad()
def run_hf_generate(model, workload: Workload) -> SystemResult:
    """One static batch: left padding, attention mask, exactly output_len new tokens."""
    n = workload.output_len

    def gen(prompts: Sequence[Sequence[int]], new: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
            pad_token_id=0, num_beams=1,
        )
        return out[:, width:].tolist()

    with quiet_transformers():
        gen([p[:8] for p in workload.prompts[:2]], 2)  # warm-up
        start = time.perf_counter()
        outputs = gen(workload.prompts, n)
        seconds = time.perf_counter() - start
    return SystemResult(HF_GENERATE, outputs, seconds)


@torch.no_grad()
def run_hf_generate_batch(model, workload: Workload) -> SystemResult:
    """transformers continuous batching (paged KV cache, SDPA on CPU), EOS disabled."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    def gen(prompts: list[list[int]], new: int) -> list[list[int]]:
        config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
        # Size the paged cache for the workload: left to itself it sizes from free memory (GPU-minded)
        # and allocates gigabytes on CPU. The batch token budget matches the engine's prefill budget.
        page = 64
        blocks = sum(-(-(len(p) + new) // page) for p in prompts) + 2
        cb = ContinuousBatchingConfig(
            auto_switch_to_flash=False, page_size=page, num_blocks=blocks, max_batch_tokens=ENGINE_PREFILL_TOKENS
        )
        # warmup=False: on CPU there are no CUDA graphs to capture, only a dummy max-size forward.
        results = model.generate_batch(
            inputs=prompts, generation_config=config, continuous_batching_config=cb, progress_bar=False, warmup=False
        )
        outs = list(results.values())
        if len(outs) != len(prompts) or any(o.error for o in outs):
            raise RuntimeError(f"generate_batch failed: {[o.error for o in outs if o.error]}")
        return [list(o.generated_tokens) for o in outs]

    with quiet_transformers():
        gen([p[:8] for p in workload.prompts[:2]], 2)  # warm-up
        start = time.perf_counter()
        outputs = gen(workload.prompts, workload.output_len)
        seconds = time.perf_counter() - start
    return SystemResult(HF_BATCH, outputs, seconds)


@contextlib.contextmanager
def quiet_transformers(hide_stderr: bool = True):
    """Hide transformers' info/warning chatter (GGUF loading, generation config notes); with
    hide_stderr, everything else it prints to stderr too."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()) if hide_stderr else contextlib.nullcontext():
            yield
    finally:
        logger.setLevel(level)


# ------------------------------------------------------------------------------------ report


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
    print_fn: Callable[[str], None] = print,
) -> BenchReport:
    """Run the workload on every system and print the table; returns the measurements."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if threads:
        torch.set_num_threads(threads)
    workload = make_workload(prompts, min_len, max_len, output_len, seed)
    report = BenchReport(workload, dtype, torch.get_num_threads())
    print_fn(
        f"workload: {prompts} prompts of {min_len}-{max_len} tokens ({workload.input_tokens} input tokens), "
        f"{output_len} output tokens each, greedy, ignore EOS; dtype {dtype}, {report.threads} threads, seed {seed}"
    )
    report.results.append(run_engine(workload, dtype, model_path))
    if not skip_transformers:
        hf = load_hf_model(dtype, model_path)
        report.results.append(run_hf_generate(hf, workload))
        report.results.append(run_hf_generate_batch(hf, workload))
        del hf
    for line in format_report(report):
        print_fn(line)
    return report


def format_report(report: BenchReport) -> list[str]:
    ours = report.result(ENGINE)
    header = f"{'system':<28} {'output tokens':>13} {'seconds':>9} {'tok/s':>9} {'ours/this':>9}"
    lines = [header, "-" * len(header)]
    for r in report.results:
        ratio = ours.tok_per_s / r.tok_per_s if ours and r.tok_per_s else float("nan")
        lines.append(f"{r.name:<28} {r.output_tokens:>13} {r.seconds:>9.2f} {r.tok_per_s:>9.1f} {ratio:>8.2f}x")
    expected = report.workload.expected_output_tokens
    ok = all(len(o) == report.workload.output_len for r in report.results for o in r.outputs)
    counts = ", ".join(f"{r.name}={r.output_tokens}" for r in report.results)
    lines.append(f"token counts: {'OK' if ok else 'MISMATCH'} (expected {expected}: {counts})")
    hf = report.result(HF_GENERATE)
    if ours and hf:
        if report.dtype == "float32":
            same = sum(a == b for a, b in zip(ours.outputs, hf.outputs))
            lines.append(f"greedy match vs {HF_GENERATE}: {same}/{len(ours.outputs)} sequences identical (informational)")
        else:
            lines.append(f"greedy match vs {HF_GENERATE}: skipped ({report.dtype}; float32 only)")
    return lines


def main_bench(args) -> int:
    run_bench(
        prompts=args.prompts, min_len=args.min_len, max_len=args.max_len, output_len=args.output_len,
        dtype=args.dtype or "float32", threads=args.threads, seed=args.seed, skip_transformers=args.skip_transformers,
        model_path=args.model,
    )
    return 0
