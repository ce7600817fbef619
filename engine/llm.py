"""`LLM`: load a model, then generate text for prompts or token-id lists on the kvledger engine."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Sequence, Union

import torch

from kvledger.engine.attention.torch_native import TorchNativeBackend
from kvledger.engine.kv_pool import KVPool
from kvledger.engine.model import CausalLM
from kvledger.engine.observers import ShadowVerifier, TraceRecorder
from kvledger.engine.engine_config import EngineConfig
from kvledger.engine.options import DTYPE_NAMES, validate_for_model
from kvledger.engine.scheduler import Scheduler, SchedulerConfig
from kvledger.engine.tokenizer import Tokenizer
from kvledger.engine.weights import load_weights
from kvledger.fast import AdmissionPolicy, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]  # SamplingParams: the seed's, what users pass to generate

Prompt = Union[str, Sequence[int]]
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass
class RequestOutput:
    uid: int
    prompt_token_ids: List[int]
    token_ids: List[int] = field(default_factory=list)
    text: str = ""
    finish_reason: Optional[str] = None  # "length", "stop", "error"
    error: Optional[Exception] = None  # the ValueError (naming the field) of a rejected request, or why it failed
    cached_tokens: int = 0  # prompt tokens found in the prefix cache


class LLM:
    def __init__(self, model: Any = None, *, config: Optional[EngineConfig] = None, **options: Any) -> None:
        """`LLM(model, **options)` or `LLM(config=EngineConfig(...))`: the options are EngineConfig's
        fields (engine/engine_config.py says what each means and its default). Raises
        EngineOptionError (a ValueError naming the option) for a bad option before loading anything."""
        if config is None:
            config = EngineConfig.create(model=model, **options)
        elif model is not None or options:
            raise TypeError("LLM: pass either config or options, not both")
        self.options = o = config
        if o.threads is not None:
            torch.set_num_threads(o.threads)
        model_config, state = load_weights(o.model, dummy=o.dummy_weights, seed=o.seed)
        validate_for_model(o.max_seq_len, model_config)
        self.config = model_config  # the model's hyper-parameters (self.options: the engine's)
        self.tokenizer = None if o.dummy_weights or not _has_tokenizer(o.model) else Tokenizer.load(o.model)
        self.model = CausalLM.from_state_dict(model_config, state, dtype=DTYPES[o.dtype], device=o.device)
        self.model.attn_backend = _attention_backend(o.attention, o.device)
        del state
        kv_tokens = o.kv_cache_tokens
        if kv_tokens is None:
            # shadow verification compares every page after every operation: keep its pool small
            kv_tokens = 32768 if o.verify else _auto_kv_tokens(model_config, DTYPES[o.dtype], o.device,
                                                                o.max_running_reqs, o.max_prefill_tokens)
        num_pages = max(1, kv_tokens // o.page_size)  # the automatic size may be under a page
        self.model.kv_pool = KVPool.for_model(model_config, num_pages * o.page_size, DTYPES[o.dtype], o.device)
        eos = self.tokenizer.eos_token_ids if self.tokenizer else model_config.eos_token_ids
        sched = SchedulerConfig(
            num_pages=num_pages, page_size=o.page_size, cache_type=o.cache_type, max_running_reqs=o.max_running_reqs,
            max_seq_len=min(model_config.max_position_embeddings, 4096) if o.max_seq_len is None else o.max_seq_len,
            max_prefill_tokens=o.max_prefill_tokens, seed=o.seed,
            admission=AdmissionPolicy(o.admission, o.reserve_ratio))
        self.scheduler = Scheduler(self.model, sched, eos, o.device, overlap=o.overlap, cuda_graphs=o.cuda_graphs)
        self.scheduler.capture_graphs()
        self.shadow = ShadowVerifier(self.scheduler.header) if o.verify else None
        if self.shadow:
            self.scheduler.observers.append(self.shadow)
        self.recorder = TraceRecorder(o.trace, self.scheduler.header) if o.trace else None
        if self.recorder:
            self.scheduler.observers.append(self.recorder)
        self._next_uid = 0

    # -- prompts ------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> List[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer (dummy weights have none); pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def chat(self, message: str) -> List[int]:
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer")
        return self.tokenizer.apply_chat_template([{"role": "user", "content": message}])

    def _submit(self, prompt: Prompt, params: SamplingParams) -> RequestOutput:
        last = self.scheduler.driver.last_uid  # a server worker may have submitted on this engine too
        uid = max(self._next_uid, 0 if last is None else last + 1)
        self._next_uid = uid + 1
        try:
            out = RequestOutput(uid, self.encode(prompt))
            self.scheduler.submit(uid, out.prompt_token_ids, params)
        except ValueError as e:
            out = RequestOutput(uid, [] if isinstance(prompt, str) else list(prompt), finish_reason="error", error=e)
        return out

    def _decode(self, ids: List[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer else ""

    # -- generation ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: Optional[bool] = None,
    ) -> List[RequestOutput]:
        """Generate for every prompt together (continuous batching). A request that can never
        run comes back with `finish_reason == "error"` and `error` set; the others still run."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = _per_request(sampling_params, len(prompts))
        outputs = [self._submit(p, sp) for p, sp in zip(prompts, params)]
        by_uid = {o.uid: o for o in outputs if o.error is None}
        bar = _progress(len(by_uid), use_tqdm)
        while self.scheduler.has_work:
            for ev in self.scheduler.step():
                out = by_uid[ev.uid]
                out.cached_tokens = ev.cached_tokens
                if ev.error is not None:  # this request alone failed (the others go on)
                    out.error = RuntimeError(ev.error)
                else:
                    out.token_ids.append(ev.token)
                if ev.finished:
                    out.finish_reason = ev.finish_reason
                    out.text = self._decode(out.token_ids)
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return outputs

    def stream(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None) -> Iterator[str]:
        """Yield text pieces as tokens are generated (one request)."""
        out = self._submit(prompt, sampling_params or SamplingParams())
        if out.error is not None:
            raise out.error
        shown = ""
        while self.scheduler.has_work:
            for ev in self.scheduler.step():
                if ev.uid != out.uid:
                    continue
                if ev.error is not None:
                    raise RuntimeError(f"request {out.uid} failed: {ev.error}")
                out.token_ids.append(ev.token)
                text = self._decode(out.token_ids)
                if not text.endswith("\ufffd"):  # wait for a whole character
                    yield text[len(shown):]
                    shown = text

    def close(self) -> None:
        if self.recorder:
            self.recorder.close()


def _per_request(params, n: int) -> List[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params: {len(params)} given for {n} prompts")
    return params


def _progress(total: int, enabled: Optional[bool]):
    if enabled is None:
        enabled = sys.stderr.isatty() and total > 1
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req", file=sys.stderr)


def _auto_kv_tokens(config, dtype: torch.dtype, device: str, max_running_reqs: int, max_prefill_tokens: int) -> int:
    if torch.device(device).type != "cuda":
        return 32768
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    # logits in float32 (and the model dtype) for a full decode batch or a prefill's last tokens,
    # a prefill's activations, and the CUDA graphs' pool
    batch = max(max_running_reqs, 256)
    logits = batch * config.vocab_size * (4 + dtype.itemsize) * 2
    activations = max_prefill_tokens * (config.hidden_size * 8 + config.intermediate_size * 6) * 4
    reserve = logits + activations + (2 << 30)
    return KVPool.tokens_that_fit(config, dtype, free, fraction=0.9, reserve_bytes=reserve)


def _has_tokenizer(model: Optional[str]) -> bool:
    """GGUF files carry their tokenizer; a Hugging Face directory may hold weights only."""
    if model is None or not os.path.isdir(model):
        return True
    return any(os.path.exists(os.path.join(model, f)) for f in ("tokenizer.json", "tokenizer_config.json"))


def _attention_backend(name: str, device: str):
    """auto: the Triton kernel on CUDA, torch-native (gathered KV + SDPA) on the CPU."""
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name == "torch":
        return TorchNativeBackend()
    if name == "triton":
        from kvledger.engine.attention.triton_paged import TritonPagedBackend

        return TritonPagedBackend()
    raise ValueError(f"attention must be 'auto', 'torch' or 'triton', got {name!r}")
