"""Per-request sampling: greedy, temperature, top-k, top-p, each request with its own seeded
generator so a run replays identically whatever else is in the batch.

Filtering always keeps the most likely token, so no parameter value can leave an empty (all
-inf, then NaN) distribution: a top_p of 1e-46 rounds to 0 in float32 and would otherwise drop
every token. A row the sampler still cannot use (non-finite logits from the model) fails that
request alone: `sample` reports it instead of raising, and the scheduler ends the request with
finish reason "error" while the rest of the batch goes on.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Dict, List, Sequence

import torch

from kvledger.engine.runtime.request_error import RequestError
from kvledger.fast import SamplingParams

MIN_TEMPERATURE = 1e-5  # below this the logits' scale overflows; it samples the argmax anyway
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts


def validate_sampling(params: SamplingParams) -> None:
    """A RequestError (a ValueError) naming the bad field."""
    _require_number(params.temperature, "temperature")
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise RequestError("temperature", f"temperature must be a finite number >= 0, got {params.temperature}")
    _require_number(params.top_p, "top_p")
    if not 0 < params.top_p <= 1:  # also false for NaN
        raise RequestError("top_p", f"top_p must be in (0, 1], got {params.top_p}")
    _require_int(params.top_k, "top_k")
    if params.top_k == 0 or params.top_k < -1:
        raise RequestError("top_k", f"top_k must be -1 (off) or >= 1, got {params.top_k}")
    _require_int(params.max_tokens, "max_tokens")
    if params.max_tokens < 1:
        raise RequestError("max_tokens", f"max_tokens must be >= 1, got {params.max_tokens}")
    if params.seed is not None:
        _require_int(params.seed, "seed")
        if not SEED_RANGE[0] <= params.seed < SEED_RANGE[1]:
            raise RequestError("seed", f"seed must fit in 64 bits, got {params.seed}")
    for t in params.stop_token_ids:
        _require_int(t, "stop_token_ids")


def _require_int(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise RequestError(name, f"{name} must be an integer, got {value!r}")


def _require_number(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RequestError(name, f"{name} must be a number, got {value!r}")


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """One row of finite float logits -> scaled logits with the filtered-out tokens at -inf.
    The most likely token always survives."""
    logits = logits / max(temperature, MIN_TEMPERATURE)
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # keep every token up to and including the one whose cumulative mass crosses top_p
        drop = probs.cumsum(-1) - probs >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


@dataclass
class SampleResult:
    tokens: List[int]
    failed: Dict[int, str] = field(default_factory=dict)  # uid -> why its row could not be sampled


class Sampler:
    def __init__(self, base_seed: int = 0) -> None:
        self.base_seed = base_seed
        self._generators: Dict[int, torch.Generator] = {}

    def add(self, uid: int, params: SamplingParams) -> None:
        seed = params.seed if params.seed is not None else self.base_seed * 1_000_003 + uid
        self._generators[uid] = torch.Generator().manual_seed(seed)

    def remove(self, uid: int) -> None:
        self._generators.pop(uid, None)

    def sample(self, logits: torch.Tensor, uids: Sequence[int], params: Sequence[SamplingParams]) -> SampleResult:
        """logits [B, vocab] (any device) -> one token per row. A row that cannot be sampled keeps
        its argmax as a placeholder and is reported in `failed`."""
        result = SampleResult(torch.argmax(logits, dim=-1).tolist())
        for i, (uid, p) in enumerate(zip(uids, params)):
            if p.is_greedy:
                continue
            row = logits[i].float().cpu()
            if not bool(torch.isfinite(row).all()):
                result.failed[uid] = "the model produced non-finite logits for this request"
                continue
            probs = torch.softmax(filter_logits(row, p.temperature, p.top_k, p.top_p), -1)
            result.tokens[i] = int(torch.multinomial(probs, 1, generator=self._generators[uid]))
        return result
