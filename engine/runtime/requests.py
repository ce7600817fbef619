"""What the engine knows of a request: the limits a request is checked against when it arrives,
its record while it lives, and the event that delivers each of its tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, Optional, Sequence

from kvledger import fast
from kvledger.engine.runtime.request_error import RequestError
from kvledger.engine.runtime.sampling import validate_sampling
from kvledger.reference.pages import tokens_to_finish


@dataclass(frozen=True)
class RequestLimits:
    """What one engine can ever run; the server reads them to answer before submitting."""

    max_seq_len: int
    vocab_size: int
    page_size: int
    pool_tokens: int

    def validate(self, token_ids: Sequence[int], params: fast.SamplingParams) -> None:
        """Raise RequestError naming the field if the request can never run."""
        n, vocab = len(token_ids), self.vocab_size
        if n == 0:
            raise RequestError("prompt", "prompt is empty")
        # min/max first: a per-token Python check costs ~0.3 ms for a 2k-token prompt
        bad = (
            [] if 0 <= min(token_ids) and max(token_ids) < vocab else [t for t in token_ids if not 0 <= int(t) < vocab]
        )
        if bad:
            raise RequestError("prompt", f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        validate_sampling(params)
        bad = [t for t in params.stop_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise RequestError("stop_token_ids", f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        limit = self.max_seq_len
        if n >= limit:
            raise RequestError(
                "prompt", f"prompt is {n} tokens, longer than max_seq_len allows ({limit - 1} + 1 generated)"
            )
        if n + params.max_tokens > limit:
            raise RequestError(
                "max_tokens", f"max_tokens {params.max_tokens} plus the {n}-token prompt exceeds max_seq_len {limit}"
            )
        need = tokens_to_finish(0, n + params.max_tokens, self.page_size)
        if need > self.pool_tokens:
            raise RequestError(
                "max_tokens",
                f"max_tokens {params.max_tokens}: the request may need {need} "
                f"KV tokens, the pool holds {self.pool_tokens}",
            )


@dataclass
class RequestRecord:
    """The engine's state of one request, from submit until it ends; dropped then. (Its pages and
    page-table row are the cache scheduler's; its sampling generator is the sampler's.)"""

    uid: int
    params: fast.SamplingParams
    stop_ids: FrozenSet[int] = frozenset()  # tokens that end it: its stop_token_ids, and EOS unless ignore_eos
    cached_tokens: Optional[int] = None  # prompt tokens found in the prefix cache, set at admission
    finishing: Optional[str] = None  # its finish reason once bookkeeping released it, before delivery

    @classmethod
    def of(cls, uid: int, params: fast.SamplingParams, eos_token_ids: FrozenSet[int]) -> RequestRecord:
        stops = frozenset(params.stop_token_ids)
        return cls(uid, params, stops if params.ignore_eos else stops | eos_token_ids)


@dataclass
class TokenEvent:
    uid: int
    token: int
    finished: bool
    finish_reason: Optional[str]  # "length", "stop" (EOS or a stop token), "error", or None
    error: Optional[str] = None  # why the request failed (finish_reason "error"); its token is not output
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
