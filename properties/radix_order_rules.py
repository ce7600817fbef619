"""`RadixOrderRules`: the lockstep rules for the states where the radix cache's eviction order
depends on its bookkeeping (`EvictionOrderWatch` notes them; fast keeps a heap, the reference
scans every leaf)."""

from __future__ import annotations

from typing import List, Tuple

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvledger.properties.lockstep_core import ALPHABET, LockstepCore


class RadixOrderRules(LockstepCore):
    @precondition(lambda self: self.header.cache_type == "radix" and not self.ref.waiting)
    @rule(
        family=st.integers(0, 2),
        tail=st.lists(ALPHABET, max_size=8),
        arrivals=st.lists(st.tuples(st.integers(0, 1), st.sampled_from([0, 1, 2, 4, 8])), min_size=2, max_size=4),
        again=st.booleans(),
        evict=st.none() | st.floats(0.0, 1.0),
    )
    def burst(
        self, family: int, tail: List[int], arrivals: List[Tuple[int, int]], again: bool, evict: float | None
    ) -> None:
        """Short requests (one output token: they end at their prefill) arrive together and prefill
        in one batch; then, maybe, an eviction. Each prompt is the family's start, a branch token
        (0 or 1) and the first `cut` tokens of `tail`: prompts on one branch are prefixes of one
        another, the two branches are separate leaves; with `again` the first request arrives
        once more at the end (a retry). In one batch a request's insert comes after those ahead
        of it, which ended and unlocked theirs: it extends an evictable leaf (the leaf gains a
        child), or stamps again a leaf older than one cached since (a repeated prompt), and the
        eviction's order shows whether the prefix cache re-keyed those leaves."""
        arrivals = arrivals + arrivals[:1] * again
        fam = self.families[family % len(self.families)]
        share = max(1, self.pool // len(arrivals) - self.header.page_size)  # so that most of them fit
        keep = min(len(fam), share // 2)
        for branch, cut in arrivals:
            self.submit(family, keep, ([branch] + tail[:cut])[: share - keep], 1)
        self._do({"op": "prefill", "budget": 1024, "sample": [0]})
        if evict is not None:
            self.evict(max(evict, 1e-9))

    @precondition(lambda self: self.header.cache_type == "radix")
    @rule(family=st.integers(0, 2), keep=st.integers(1, 48), times=st.integers(1, 48))
    def hot_prefix(self, family: int, keep: int, times: int) -> None:
        """A hot prefix, matched again and again between evictions: each match of a cached leaf
        re-enters it in fast's heap of evictable leaves, so stale entries pile up until the heap
        drops them all at once (it keeps at most 4 per node, plus 64). A prefix nothing of which is
        cached is not hot: the loop stops there."""
        tokens = self.families[family % len(self.families)][:keep]
        for _ in range(times):
            if not self._do({"op": "probe", "tokens": tokens}).cached_len:
                break
