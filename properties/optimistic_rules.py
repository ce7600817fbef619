"""`OptimisticRules`: the lockstep rules that only optimistic and adaptive admission run.

Random rule choice rarely decodes often enough in a row to outgrow a pool; these rules do: `grow`
decodes until a step preempts, `chunk_then_grow` leaves a request mid-chunk first (then continues
it), `outgrown_chunk` does so from idle, where the continuation's step loses its whole batch,
`stream` has short same-prefix requests arrive one per step (several victims in one step), and
`drain` checks liveness: with no new requests, driving the scheduler as the engine does ends every
request within a bound counted from what is outstanding (operations, never time).
"""

from __future__ import annotations

from typing import List, Tuple

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvledger.properties.lockstep_core import ALPHABET, SAMPLE, LockstepCore
from kvledger.reference.pages import div_ceil


class OptimisticRules(LockstepCore):
    @precondition(lambda self: self.optimistic and self.ref.dm.runnable)
    @rule(sample=SAMPLE, steps=st.integers(1, 16))
    def grow(self, sample: List[int], steps: int) -> None:
        """Optimistic only: decode until a step preempts (at most `steps` steps). Random rule
        choice rarely decodes often enough in a row to outgrow the pool; this does."""
        self._grow(sample, steps)

    def _grow(self, sample: List[int], steps: int) -> bool:
        """Decode until a step preempts (True) or `steps` steps ran or nothing runs (False)."""
        for _ in range(steps):
            if not self.ref.dm.runnable:
                return False
            if self._do({"op": "decode", "sample": sample}).preempted:
                return True
        return False

    @precondition(lambda self: self.optimistic and self.ref.dm.runnable and self.ref.waiting)
    @rule(budget=st.integers(1, 3), sample=SAMPLE, steps=st.integers(1, 16), fill=st.booleans())
    def chunk_then_grow(self, budget: int, sample: List[int], steps: int, fill: bool) -> None:
        """Optimistic only: admit a chunk of the next request, then decode the running ones
        until a step preempts (the request left mid-chunk is the newest, so it goes first) or,
        with `fill`, only while a decode still fits; then go on with the chunk. The decodes took
        pages admission had counted on for the rest of its prompt, so the continuation may not fit
        either: it preempts the request mid-chunk, and with it the whole step."""
        self.prefill(budget, sample)
        if fill:
            cm = self.ref.cm
            for _ in range(steps):
                if not self.ref.dm.runnable or cm.needed_size(list(self.ref.dm.running_reqs)) > cm.available_size:
                    break
                self.decode(sample)
        elif self._grow(sample, steps):
            return
        if self.ref.waiting:
            self.prefill(1024, sample)

    @precondition(lambda self: self.optimistic and not self.ref.waiting and not self.ref.live)
    @rule(family=st.integers(0, 2), sample=SAMPLE)
    def outgrown_chunk(self, family: int, sample: List[int]) -> None:
        """Optimistic only, from idle: a one-token request that may grow to the whole pool runs,
        then chunk_then_grow admits a half-pool prompt one token at a time and decodes the first
        while a decode fits. The chunk's continuation no longer fits: its step preempts the request
        mid-chunk, the whole batch. From an arbitrary state the half-pool prompt is mostly turned
        away instead, and no step loses its whole batch."""
        self.submit(family, 1, [], self.pool)
        self._do({"op": "prefill", "budget": 1024, "sample": sample})
        self.submit(family, self.pool, [0] * self.pool, 1)
        self.chunk_then_grow(1, sample, self.pool, True)

    @precondition(lambda self: self.optimistic and not self.ref.waiting and not self.ref.live)
    @rule(
        family=st.integers(0, 2),
        keep=st.integers(1, 6),
        arrivals=st.lists(st.tuples(st.lists(ALPHABET, max_size=1), st.integers(1, 24)), min_size=3, max_size=6),
        sample=SAMPLE,
        steps=st.integers(1, 16),
    )
    def stream(
        self, family: int, keep: int, arrivals: List[Tuple[List[int], int]], sample: List[int], steps: int
    ) -> None:
        """Optimistic only, from idle: short requests over one shared prefix arrive one per step
        (submit, prefill, decode) until a step preempts; if none did, the running ones decode
        until one does. Admission (at ratio 0 it reserves only the prefill) fills the pool to the
        brim; the newest
        requests hold only a token or two of their own (the prefix is the cache's, locked by the
        older ones), so freeing one victim is often too little: a step preempts several."""
        for suffix, max_tokens in arrivals:
            self.submit(family, keep, suffix, max_tokens)
            if self._do({"op": "prefill", "budget": 1024, "sample": sample}).preempted:
                return
            if self.ref.dm.runnable and self._do({"op": "decode", "sample": sample}).preempted:
                return
        self._grow(sample, steps)

    @precondition(lambda self: self.optimistic and not self.drained and (self.ref.waiting or self.ref.live))
    @rule(budget=st.sampled_from([2, 5, 16, 1024]), sample=st.lists(ALPHABET, min_size=1, max_size=4))
    def drain(self, budget: int, sample: List[int]) -> None:
        """Liveness under optimistic admission: submit nothing more and drive the scheduler as the
        engine does (prefill if admission yields a batch, else decode); every request, waiting or
        live, ends within a bound counted from what is outstanding, however often it is preempted.
        Once per example: a drain is long, and the CI profile's time is bounded."""
        self.drained = True
        ref = self.ref
        requests = len({p.uid for p in ref.waiting} | set(ref.live))
        tokens = sum(r.max_device_len - r.device_len + 1 for r in ref.live.values()) + sum(
            p.output_len + div_ceil(p.input_len, budget) for p in ref.waiting
        )
        bound = (requests + 1) * tokens + 10
        before, ops = self.preempted_seen, 0
        while ref.waiting or ref.live:
            self._check(
                ops < bound,
                f"liveness: {len(ref.waiting)} waiting and {len(ref.live)} live requests "
                f"still there after {ops} operations (bound {bound})",
            )
            if ref.waiting:
                result = self._do({"op": "prefill", "budget": budget, "sample": sample})
                ops += 1
                if result.batch or result.preempted:
                    continue
            self._check(
                ref.dm.runnable,
                f"liveness: nothing admitted and nothing running; waiting "
                f"{[p.uid for p in ref.waiting]}, live {sorted(ref.live)}",
            )
            self._do({"op": "decode", "sample": sample})
            ops += 1
        if self.preempted_seen > before:
            self.note("driver: drain ended requests that were preempted")
