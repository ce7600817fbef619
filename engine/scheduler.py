"""The engine's scheduler: prefill-first continuous batching on the `fast` cache manager.

Each step admits from the queue within a token budget (worst-case reservation, chunked prefill,
radix prefix reuse) or, if nothing was admitted, decodes every running request; allocates pages,
runs the model over the page table, samples, and completes the step (finishes in one lazy-free
region, `cache_req` after prefill and at finish). The cache-side steps are those of
`properties.driver.Driver`, so every step is one trace operation that replays on both
implementations; observers (trace recorder, shadow verifier) see each operation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

import fast
from engine.attention.base import AttentionBatch
from engine.model import CausalLM
from engine.sampling import Sampler, validate_sampling
from properties.driver import Driver, _is_chunked
from properties.trace import Header
from reference.pages import tokens_to_finish

Observer = Callable[[int, Dict, Driver], None]


@dataclass
class SchedulerConfig:
    num_pages: int
    page_size: int = 16
    cache_type: str = "radix"
    max_running_reqs: int = 64
    max_seq_len: int = 2048
    max_prefill_tokens: int = 2048
    seed: int = 0


@dataclass
class TokenEvent:
    uid: int
    token: int
    finished: bool
    finish_reason: Optional[str]  # "length", "stop" (EOS or a stop token), or None


class Scheduler:
    def __init__(self, model: CausalLM, config: SchedulerConfig, eos_token_ids: Sequence[int] = (),
                 device: str | torch.device = "cpu") -> None:
        self.model = model
        self.config = config
        self.device = torch.device(device)
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.header = Header(num_pages=config.num_pages, page_size=config.page_size, cache_type=config.cache_type,
                             table_slots=config.max_running_reqs, max_seq_len=config.max_seq_len,
                             seed=config.seed, producer="engine")
        self.driver = Driver(fast, device=str(self.device), **self.header.driver_args())
        self.sampler = Sampler(config.seed)
        self.params: Dict[int, fast.SamplingParams] = {}
        self.observers: List[Observer] = []
        self.step_no = 0
        self.prefix_hit_tokens: Dict[int, int] = {}  # uid -> prompt tokens found in the prefix cache

    # -- requests -----------------------------------------------------------------------------
    def validate(self, token_ids: Sequence[int], params: fast.SamplingParams) -> None:
        """Raise ValueError naming the field if the request can never run."""
        n = len(token_ids)
        if n == 0:
            raise ValueError("prompt is empty")
        bad = [t for t in token_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        validate_sampling(params)
        limit = self.config.max_seq_len
        if n >= limit:
            raise ValueError(f"prompt is {n} tokens, longer than max_seq_len allows ({limit - 1} + 1 generated)")
        if n + params.max_tokens > limit:
            raise ValueError(f"max_tokens {params.max_tokens} plus the {n}-token prompt exceeds max_seq_len {limit}")
        pool = self.config.num_pages * self.config.page_size
        need = tokens_to_finish(0, n + params.max_tokens, self.config.page_size)
        if need > pool:
            raise ValueError(f"max_tokens {params.max_tokens}: the request may need {need} KV tokens, the pool holds {pool}")

    def submit(self, uid: int, token_ids: Sequence[int], params: fast.SamplingParams) -> None:
        ids = [int(t) for t in token_ids]
        self.validate(ids, params)
        self.params[uid] = params
        self.sampler.add(uid, params)
        self._do({"op": "submit", "uid": uid, "tokens": ids, "max_tokens": params.max_tokens})

    def abort(self, uid: int) -> None:
        """Drop a waiting or running request and free its slot and pages at once."""
        self._do({"op": "abort", "uid": uid})
        self._forget(uid)

    @property
    def has_work(self) -> bool:
        return bool(self.driver.waiting or self.driver.dm.runnable)

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> List[TokenEvent]:
        d = self.driver
        batch, phase = [], "prefill"
        if d.waiting:
            batch, _ = d.admit(self.config.max_prefill_tokens)
            for req in batch:
                self.prefix_hit_tokens.setdefault(req.uid, req.cached_len)
        if not batch:
            batch, phase = list(d.dm.running_reqs.values()), "decode"
        if not batch:
            self.check_idle()
            return []
        d.allocate(batch)
        logits = self._forward(batch)
        sampled = [i for i, r in enumerate(batch) if not _is_chunked(r)]
        tokens = self.sampler.sample(logits[sampled], [batch[i].uid for i in sampled],
                                     [self.params[batch[i].uid] for i in sampled])
        sample = [0] * len(batch)
        for i, t in zip(sampled, tokens):
            sample[i] = t
        stop = [batch[i].uid for i, t in zip(sampled, tokens) if self._stops(batch[i].uid, t)]
        d.complete(batch, sample, stop, phase == "prefill")
        op: Dict = {"op": phase, "sample": sample, "stop": stop, "expect": {"batch": [r.uid for r in batch]}}
        if phase == "prefill":
            op = {"op": "prefill", "budget": self.config.max_prefill_tokens, **{k: v for k, v in op.items() if k != "op"}}
        self._notify(op)
        events = []
        for i, t in zip(sampled, tokens):
            req = batch[i]
            stopped = req.uid in stop
            finished = stopped or not req.can_decode
            events.append(TokenEvent(req.uid, t, finished, "stop" if stopped else ("length" if finished else None)))
            if finished:
                self._forget(req.uid)
        if not self.has_work:
            self.check_idle()
        return events

    def check_idle(self) -> None:
        """With nothing live: every page is free or cached, no lock held, and the partition holds."""
        if not self.driver.live:
            self.driver.cm.check_integrity()
            self.driver.check()

    # -- internals ----------------------------------------------------------------------------
    def _forward(self, batch: List) -> torch.Tensor:
        ids = torch.cat([r.input_ids[r.cached_len : r.device_len] for r in batch]).to(self.device, torch.long)
        attn = AttentionBatch.from_page_table(self.driver.page_table, [r.table_idx for r in batch],
                                              [r.cached_len for r in batch], [r.device_len for r in batch])
        return self.model(ids, attn.positions, attn)

    def _stops(self, uid: int, token: int) -> bool:
        p = self.params[uid]
        return (not p.ignore_eos and token in self.eos_token_ids) or token in set(p.stop_token_ids)

    def _do(self, op: Dict) -> None:
        self.driver.apply(op)
        self._notify(op)

    def _notify(self, op: Dict) -> None:
        self.step_no += 1
        for observer in self.observers:
            observer(self.step_no, op, self.driver)

    def _forget(self, uid: int) -> None:
        self.params.pop(uid, None)
        self.sampler.remove(uid)
