"""The batch choice: prefill first, then decode, on the engine's cache scheduler.

Each step admits from the queue within the prefill token budget (worst-case or optimistic
reservation, chunked prefill, radix prefix reuse); if nothing was admitted, every running request
decodes. The batch then gets its pages; under optimistic admission a batch that does not fit
first preempts the newest live requests. Admission and allocation are the cache scheduler's
(`engine/ledger/cache_scheduler.py`), so the engine's steps are exactly those a trace replays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from kvledger.engine.ledger.cache_scheduler import CacheScheduler


@dataclass
class Batch:
    """One step's batch, as the model runs it."""

    phase: str  # "prefill" or "decode"
    requests: List[Any]  # the cache scheduler's requests, in batch order
    preempted: List[int] = field(default_factory=list)  # uids preempted to make room for it
    sampled: List[int] = field(default_factory=list)  # batch indices that sample a token (not mid-chunk)
    # what admission took, with each request's cached length then (before any preemption)
    admitted: List[Tuple[Any, int]] = field(default_factory=list)
    hits: Dict[int, int] = field(default_factory=dict)  # newly admitted uid -> prefix-cache hit


# told of a step that changed the cache but computes nothing: (phase, uids preempted)
EmptyStep = Callable[[str, List[int]], None]


class Scheduler:
    def __init__(self, ledger: CacheScheduler, max_prefill_tokens: int, on_empty_step: EmptyStep) -> None:
        self.ledger = ledger
        self.max_prefill_tokens = max_prefill_tokens
        self.on_empty_step = on_empty_step

    def schedule(self) -> Optional[Batch]:
        """The next batch with its pages allocated, or None when there is nothing to run. A batch
        whose requests were all preempted comes back empty (its preemptions happened)."""
        ledger = self.ledger
        batch: List[Any] = []
        hits: Dict[int, int] = {}
        phase = "prefill"
        if ledger.queue_length():
            batch, _ = ledger.admit(self.max_prefill_tokens)
            hits = ledger.admission_hits()
            if not batch:
                # the attempt's prefix match may have split a radix node and touched its LRU
                # clock: it is an operation of its own, or traces and the shadow miss it
                self.on_empty_step("prefill", [])
        if not batch:
            batch, phase = ledger.running_requests(), "decode"
        if not batch:
            return None
        admitted = [(r, r.cached_len) for r in batch] if phase == "prefill" else []
        runs, preempted = ledger.allocate(batch)
        sampled = [i for i, r in enumerate(runs) if not ledger.is_chunked(r)]
        return Batch(phase, runs, preempted, sampled, admitted, hits)
