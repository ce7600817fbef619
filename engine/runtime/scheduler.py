"""The batch choice: prefill first, then decode, on the engine's cache scheduler.

Each step admits from the queue within the prefill token budget (worst-case or optimistic
reservation, chunked prefill, radix prefix reuse); if nothing was admitted, every running request
decodes. The batch then gets its pages; under optimistic admission a batch that does not fit
first preempts the newest live requests. Admission and allocation are the cache scheduler's
(`engine/ledger/cache_scheduler.py`), so the engine's steps are exactly those a trace replays. A
step that changed the cache but computes nothing (an admission attempt that admitted nothing, a
batch whose requests were all preempted) is recorded here, as an operation of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.engine.runtime.op_stream import OpStream, step_record


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


class Scheduler:
    def __init__(self, cache_scheduler: CacheScheduler, ops: OpStream, max_prefill_tokens: int) -> None:
        self.cache_scheduler = cache_scheduler
        self.ops = ops  # a step that changed the cache but computes nothing is an operation of its own
        self.max_prefill_tokens = max_prefill_tokens

    def schedule(self) -> Optional[Batch]:
        """The next batch with its pages allocated, or None when there is nothing to run. A batch
        whose requests were all preempted comes back empty (its preemptions happened, and its
        operation is recorded)."""
        cache = self.cache_scheduler
        batch: List[Any] = []
        hits: Dict[int, int] = {}
        phase = "prefill"
        if cache.queue_length():
            batch, _ = cache.admit(self.max_prefill_tokens)
            hits = cache.admission_hits()
            if not batch:
                # the attempt's prefix match may have split a radix node and touched its LRU
                # clock: it is an operation of its own, or traces and the shadow miss it
                self._record_empty("prefill", [])
        if not batch:
            batch, phase = cache.running_requests(), "decode"
        if not batch:
            return None
        admitted = [(r, r.cached_len) for r in batch] if phase == "prefill" else []
        runs, preempted = cache.allocate(batch)
        sampled = cache.sampled_rows(runs)
        if not runs:  # every request of the step was preempted: nothing to compute
            self._record_empty(phase, preempted)
        return Batch(phase, runs, preempted, sampled, admitted, hits)

    def _record_empty(self, phase: str, preempted: List[int]) -> None:
        record = step_record(phase, self.max_prefill_tokens, [], [], [], preempted, self.cache_scheduler.preempts)
        self.ops.record(record)
