"""`LLM`: load a model, then generate text for prompts or token-id lists on the kvledger engine."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union, cast

from kvledger.engine.distributed.group import TensorParallelGroup
from kvledger.engine.distributed.ranks import RankProcesses
from kvledger.engine.distributed.replicated_engine import RankHook, ReplicatedEngine
from kvledger.engine.engine_config import EngineConfig
from kvledger.engine.ledger.recorder import TraceRecorder
from kvledger.engine.ledger.shadow import ShadowVerifier
from kvledger.engine.model.default_model import default_model_path
from kvledger.engine.model.tokenizer import Tokenizer
from kvledger.engine.model.weights import ensure_gguf_cache, model_config
from kvledger.engine.options import validate_for_model
from kvledger.engine.runtime.build import build_rank, rank_device
from kvledger.engine.runtime.requests import TokenEvent
from kvledger.fast import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]  # SamplingParams: the seed's, what users pass to generate

Prompt = Union[str, Sequence[int]]


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
    def __init__(
        self,
        model: Any = None,
        *,
        engine_config: Optional[EngineConfig] = None,
        rank_hook: Optional[RankHook] = None,
        **options: Any,
    ) -> None:
        """`LLM(model, **options)` or `LLM(engine_config=EngineConfig(...))`: the options are
        EngineConfig's fields (engine/engine_config.py says what each means and its default). Raises
        EngineOptionError (a ValueError naming the option) for a bad option before loading anything.
        `engine_config` is the engine's configuration; `model_config`, once loaded, the model's.

        With `tensor_parallel_size` N > 1 the other N-1 ranks run in processes of their own
        (engine/distributed/ranks.py); call `close()` (or use `with LLM(...) as llm`) to stop them.
        `rank_hook(rank, step, engine)` runs on every rank before each step (fault-injection tests)."""
        if engine_config is None:
            engine_config = EngineConfig.create(model=model, **options)
        elif model is not None or options:
            raise TypeError("LLM: pass either engine_config or options, not both")
        self.engine_config = o = engine_config
        self.ranks: Optional[RankProcesses] = None
        self.recorder: Optional[TraceRecorder] = None
        if o.tensor_parallel_size > 1:
            validate_for_model(o.max_seq_len, model_config(o.model), o.tensor_parallel_size)
            if not o.dummy_weights and _is_gguf(o.model):
                ensure_gguf_cache(o.model or default_model_path())  # once here, not on every rank
        device = rank_device(o.device, 0, o.tensor_parallel_size)
        try:
            if o.tensor_parallel_size > 1:
                self.ranks = RankProcesses.start(o, device, rank_hook)
            group = self.ranks.group if self.ranks else TensorParallelGroup()
            self.tokenizer = None if o.dummy_weights or not _has_tokenizer(o.model) else Tokenizer.load(o.model)
            eos = self.tokenizer.eos_token_ids if self.tokenizer else None  # None: the model config's
            built = build_rank(o, group, device, eos, rank_hook)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close(clean=False)
            raise
        self.model_config = built.model_config  # the model's hyper-parameters (engine_config: the engine's)
        self.model = built.model
        self.engine = built.engine
        if self.ranks is not None and built.coordination is not None:
            built.coordination.explain = self.ranks.explain
        self.shadow = ShadowVerifier(self.engine.header) if o.verify else None
        if self.shadow:
            self.engine.observers.append(self.shadow)
        self.recorder = TraceRecorder(o.trace, self.engine.header) if o.trace else None
        if self.recorder:
            self.engine.observers.append(self.recorder)
        self._next_uid = 0

    # -- prompts ------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> List[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer (dummy weights have none); pass token ids")
            return self.tokenizer.encode(prompt)
        return list(map(int, prompt))

    def chat(self, message: str) -> List[int]:
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer")
        return self.tokenizer.apply_chat_template([{"role": "user", "content": message}])

    def _submit(self, prompt: Prompt, params: SamplingParams) -> RequestOutput:
        # a server worker may have submitted on this engine too: the engine knows the next free uid
        uid = max(self._next_uid, self.engine.next_uid())
        self._next_uid = uid + 1
        try:
            out = RequestOutput(uid, self.encode(prompt))
            self.engine.add_request(out.prompt_token_ids, params, uid)
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
        prompts = _prompt_list(prompts)
        params = _per_request(sampling_params, len(prompts))
        outputs: List[RequestOutput] = []
        by_uid: Dict[int, RequestOutput] = {}
        bar = _progress(len(prompts), use_tqdm)
        todo = iter(zip(prompts, params))
        # Submitting a 2k-token prompt costs about a millisecond of host time. Requests are
        # submitted only while fewer than max_running_req + 1 wait, the most that one admission
        # can look at, so steps are scheduled exactly as with everything submitted up front.
        # The rest are submitted between steps, while the GPU runs the one in flight.
        enough = self.engine_config.max_running_req + 1

        def submit_more() -> None:
            while len(outputs) < len(prompts) and self.engine.waiting_requests < enough:
                out = self._submit(*next(todo))
                outputs.append(out)
                if out.error is None:
                    by_uid[out.uid] = out
                elif bar is not None:
                    bar.update(1)

        submit_more()
        for ev in self._events(between_steps=submit_more):
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
        for ev in self._events():
            if ev.uid != out.uid:
                continue
            if ev.error is not None:
                raise RuntimeError(f"request {out.uid} failed: {ev.error}")
            out.token_ids.append(ev.token)
            text = self._decode(out.token_ids)
            if not text.endswith("\ufffd"):  # wait for a whole character
                yield text[len(shown) :]
                shown = text

    def _events(self, between_steps: Optional[Callable[[], None]] = None) -> Iterator[TokenEvent]:
        """Step the engine until it has no work, yielding each delivered token."""
        while self.engine.has_work:
            yield from self.engine.step()
            if between_steps is not None:
                between_steps()

    def close(self) -> None:
        """Close the trace; under tensor parallelism, stop the other ranks (idempotent)."""
        if self.recorder:
            self.recorder.close()
        ranks, self.ranks = self.ranks, None
        if ranks is not None:
            engine = self.engine
            clean = False
            if isinstance(engine, ReplicatedEngine) and engine.stopped is None:
                try:
                    engine.shutdown()
                    clean = True
                except Exception:  # a rank died since the last step: terminate them all
                    clean = False
            ranks.close(clean)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _prompt_list(prompts: Union[Prompt, Sequence[Prompt]]) -> List[Prompt]:
    """One prompt (a text or its token ids) or several, as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [cast(Sequence[int], prompts)]
    return list(cast(Sequence[Prompt], prompts))


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


def _has_tokenizer(model: Optional[str]) -> bool:
    """GGUF files carry their tokenizer; a Hugging Face directory may hold weights only."""
    if model is None or not os.path.isdir(model):
        return True
    return any(os.path.exists(os.path.join(model, f)) for f in ("tokenizer.json", "tokenizer_config.json"))


def _is_gguf(model: Optional[str]) -> bool:
    return model is None or str(model).endswith(".gguf")
