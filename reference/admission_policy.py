"""How much KV admission reserves for a request: its worst case, or a fraction of its output.

`reserve` (the seed's policy, the default) reserves the rest of the prompt plus every token the
request may still generate, so a running request never finds the pool empty and nothing is ever
preempted. `optimistic` (the seed's exercise 2, what vLLM, SGLang and nano-vllm do) reserves the
rest of the prompt plus `reserve_ratio` of the output still allowed; when a step's pages then do not
fit, the most recently admitted request is preempted (see `preemption.py`). `adaptive` is
optimistic with the ratio learned from the requests that ended (`ObservedOutputRatio`): it starts
at `reserve_ratio` and then follows what requests actually generate.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, replace
from typing import Deque

from .pages import tokens_to_finish

POLICIES = ("reserve", "optimistic", "adaptive")
_SCALE = 1_000_000  # the ratio in millionths: exact integer arithmetic, the same on every machine


@dataclass(frozen=True)
class AdmissionPolicy:
    kind: str = "reserve"
    reserve_ratio: float = 0.5  # optimistic only: the fraction of the remaining max_tokens reserved

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise ValueError(f"admission must be one of {', '.join(POLICIES)}, got {self.kind!r}")
        ratio = self.reserve_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
            raise ValueError(f"reserve_ratio must be a number in [0, 1], got {ratio!r}")

    @property
    def preempts(self) -> bool:
        return self.kind != "reserve"

    def with_ratio(self, reserve_ratio: float) -> AdmissionPolicy:
        return replace(self, reserve_ratio=reserve_ratio)

    def reserved_tokens(self, cached_len: int, device_len: int, max_device_len: int, page_size: int) -> int:
        """KV still to reserve, in tokens of whole pages, for a request that holds [0, cached_len),
        has `device_len` tokens (prompt and output so far) and may grow to `max_device_len`.

        Optimistic: up to device_len + ceil(ratio * (max_device_len - device_len)); while the request
        may still grow that is at least one more token, so its next step is always counted."""
        if self.kind == "reserve":
            return tokens_to_finish(cached_len, max_device_len, page_size)
        remaining = max_device_len - device_len
        millionths = round(self.reserve_ratio * _SCALE)
        target = device_len + -(-remaining * millionths // _SCALE)
        if remaining > 0:
            target = max(target, device_len + 1)
        return tokens_to_finish(cached_len, target, page_size)


RESERVE = AdmissionPolicy()


class ObservedOutputRatio:
    """The ratio adaptive admission reserves: the mean fraction of `max_tokens` that the last
    `window` requests to end had generated (by EOS, a stop, its length, or an abort while running).
    The reservation covers the running requests' growth together, and the sum of many requests'
    growth is close to their mean (a high percentile would reserve for every request's bad case at
    once, which is what `reserve` does); preemption absorbs the rest. Until `min_samples` requests
    have ended it is the configured ratio. Determined by the operation stream alone, so a trace
    replays it exactly.
    """

    def __init__(self, initial: float, window: int = 100, min_samples: int = 8) -> None:
        self.initial = self.ratio = initial
        self.min_samples = min_samples
        self._fractions: Deque[float] = deque(maxlen=window)

    def observe(self, generated: int, max_tokens: int) -> float:
        """A request ended after `generated` of its `max_tokens`; returns the updated ratio."""
        self._fractions.append(min(max(generated / max_tokens, 0.0), 1.0))
        if len(self._fractions) >= self.min_samples:
            self.ratio = min(max(statistics.fmean(self._fractions), 0.0), 1.0)
        return self.ratio
