"""transformers, the benchmarks' baseline: its model from the engine's weights or config, and its
three ways to generate a workload (one static batch, `generate_batch`, and continuous batching
with each request's own max_new_tokens). Each first runs a few warm-up requests, outside the
timing, and returns a SystemRun row."""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from kvledger.bench.decode_profile import sync
from kvledger.bench.runner import DTYPES, SystemRun
from kvledger.bench.workloads import Workload, pages

HF_GENERATE = "transformers generate"
HF_BATCH = "transformers generate_batch"
HF_CONTINUOUS = "transformers continuous batching"


@contextlib.contextmanager
def quiet_transformers(hide_stderr: bool = True) -> Iterator[None]:
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


# -- the model ---------------------------------------------------------------------------------------
def load_hf_model(dtype: str, model_path: Optional[str] = None, attn_implementation: str = "sdpa") -> Any:
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


def build_hf_model(
    dtype: str,
    device: str,
    attn_implementation: str,
    model: Optional[str] = None,
    hf_config: Optional[Dict[str, Any]] = None,
) -> Any:
    """transformers' model: random weights from the engine's config.json (`hf_config`), or `model`'s
    real weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with quiet_transformers(hide_stderr=False):
        if model is not None:
            return load_hf_model(dtype, model, attn_implementation=attn_implementation).to(device).eval()
        cfg = dict(hf_config or {})
        cfg.pop("torch_dtype", None)
        cfg.pop("dtype", None)
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        with torch.device(device):
            built = AutoModelForCausalLM.from_config(
                config, dtype=DTYPES[dtype], attn_implementation=attn_implementation
            )
        return built.to(device).eval()


def _accepted(fn: Callable, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The kwargs fn's signature names (transformers' continuous batching API moves between releases)."""
    params = inspect.signature(fn).parameters.items()
    names = {n for n, p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}
    return {k: v for k, v in kwargs.items() if k in names}


def make_cb_config(**wanted: Any) -> Any:
    """transformers' ContinuousBatchingConfig with the fields this release has (page_size was block_size)."""
    try:
        from transformers.generation import ContinuousBatchingConfig
    except ImportError:  # pragma: no cover - older layouts
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    names = set(inspect.signature(ContinuousBatchingConfig).parameters)
    if "page_size" in wanted and "page_size" not in names and "block_size" in names:
        wanted["block_size"] = wanted.pop("page_size")
    return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in names})


Generate = Callable[[List[List[int]], int], List[List[int]]]  # (prompts, new tokens each) -> token ids


def _timed(gen: Generate, workload: Workload, name: str) -> SystemRun:
    """Warm up on two short prompts, then time `gen` over the workload (one max_tokens for all)."""
    n = workload.uniform_max_tokens
    with quiet_transformers():
        gen([p[:8] for p in workload.prompts[:2]], 2)  # warm-up
        start = time.perf_counter()
        outputs = gen(workload.prompts, n)
        seconds = time.perf_counter() - start
    made = sum(len(o) for o in outputs)
    bad = sum(len(o) != n for o in outputs)
    return SystemRun(name, workload.input_tokens, made, workload.output_tokens, seconds, bad, outputs=outputs)


# -- the three ways to generate ------------------------------------------------------------------------
@torch.no_grad()
def run_hf_generate(model: Any, workload: Workload) -> SystemRun:
    """One static batch: left padding, attention mask, exactly max_tokens new tokens."""

    def gen(prompts: Sequence[Sequence[int]], new: int) -> List[List[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            num_beams=1,
        )
        return out[:, width:].tolist()

    return _timed(gen, workload, HF_GENERATE)


@torch.no_grad()
def run_hf_generate_batch(model: Any, workload: Workload, max_batch_tokens: int) -> SystemRun:
    """transformers continuous batching (`generate_batch`: paged KV cache, SDPA on CPU), EOS disabled."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    def gen(prompts: List[List[int]], new: int) -> List[List[int]]:
        config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
        # Size the paged cache for the workload: left to itself it sizes from free memory (GPU-minded)
        # and allocates gigabytes on CPU. The batch token budget matches the engine's prefill budget.
        page = 64
        blocks = sum(pages(len(p) + new, page) for p in prompts) + 2
        cb = ContinuousBatchingConfig(
            auto_switch_to_flash=False, page_size=page, num_blocks=blocks, max_batch_tokens=max_batch_tokens
        )
        # warmup=False: on CPU there are no CUDA graphs to capture, only a dummy max-size forward.
        results = model.generate_batch(
            inputs=prompts,
            generation_config=config,
            continuous_batching_config=cb,
            progress_bar=False,
            warmup=False,
        )
        outs = list(results.values())
        if len(outs) != len(prompts) or any(o.error for o in outs):
            raise RuntimeError(f"generate_batch failed: {[o.error for o in outs if o.error]}")
        return [list(o.generated_tokens) for o in outs]

    return _timed(gen, workload, HF_BATCH)


def _collect(manager: Any, ids: Sequence[str], timeout_s: float) -> Dict[str, Any]:
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
def run_continuous_batching(
    model: Any, workload: Workload, warmup: Workload, device: str, max_batch_tokens: Optional[int] = None
) -> SystemRun:
    """transformers continuous batching, each request with its own max_new_tokens (add_request)."""
    from transformers import GenerationConfig

    cuda = torch.device(device).type == "cuda"
    longest = max(workload.max_tokens)
    gen = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=-1, pad_token_id=0)
    if cuda:
        # transformers' own choices on a GPU: cache from free memory, batch budget, CUDA graphs, flash if
        # installed
        cb = make_cb_config(max_batch_tokens=max_batch_tokens) if max_batch_tokens else make_cb_config()
    else:
        # size the paged cache for the workload: left to itself it sizes from free memory and takes gigabytes
        page = 64
        blocks = sum(pages(len(p) + m, page) for p, m in zip(workload.prompts, workload.max_tokens))
        blocks += sum(pages(len(p) + m, page) for p, m in zip(warmup.prompts, warmup.max_tokens)) + 2
        cb = make_cb_config(
            page_size=page, num_blocks=blocks, max_batch_tokens=max_batch_tokens or 2048, auto_switch_to_flash=False
        )
    cm_kwargs: Dict[str, Any] = dict(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=60, warmup=cuda
    )
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        cm_kwargs["workload_hints"] = WorkloadHints(
            max_prompt_length=max(len(p) for p in workload.prompts),
            max_generated_length=longest,
            num_requests=len(workload.prompts),
        )
    except ImportError:  # pragma: no cover - releases without hints
        pass
    cm_kwargs = _accepted(model.continuous_batching_context_manager, cm_kwargs)

    def submit(manager: Any, w: Workload, prefix: str) -> List[str]:
        ids = []
        for i, (p, m) in enumerate(zip(w.prompts, w.max_tokens)):
            rid = f"{prefix}{i}"
            got = manager.add_request(input_ids=list(p), request_id=rid, max_new_tokens=m, eos_token_id=-1)
            if got is None and not manager.is_running():
                raise RuntimeError("transformers' manager refused a request")
            ids.append(rid)
        return ids

    timeout_s = 3600.0
    quiet = quiet_transformers(hide_stderr=False)
    with quiet, model.continuous_batching_context_manager(**cm_kwargs) as manager:
        _collect(manager, submit(manager, warmup, "warmup_"), timeout_s)  # same manager, warm
        sync(device)
        start = time.perf_counter()
        ids = submit(manager, workload, "req_")
        results = _collect(manager, ids, timeout_s)
        sync(device)
        seconds = time.perf_counter() - start
        attn = getattr(model.config, "_attn_implementation", None)
    lens = [len(results[rid].generated_tokens) for rid in ids]
    bad = sum(n != m for n, m in zip(lens, workload.max_tokens))
    return SystemRun(
        HF_CONTINUOUS,
        workload.input_tokens,
        sum(lens),
        workload.output_tokens,
        seconds,
        bad,
        {"attn_implementation": attn},
    )
