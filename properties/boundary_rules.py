"""Rules that put admission and allocation at their exact boundaries, sized from the model's state.

The plain rules draw prompt lengths blindly, so a request whose worst case fits the pool by a page
or less, or a budget of exactly the tokens two requests compute, comes up once in a few hundred
sequences: the zoo's `no-recheck-after-lock`, `evict-counts-pages` and
`budget-charges-cached-prefix` needed 190 to 260 sequences of the CI profile. Each rule here reads
the reference (the model: what it holds is the truth) and sizes its request to the boundary, a
drawn `slack` below it, so those states come within the profile's first sequences. A prefix hit is
learned through a `probe`, an operation of the trace, never by calling the reference's cache
directly (a match stamps the LRU clock, which would set the two sides apart).
"""

from __future__ import annotations

from typing import Any, Dict, List

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvledger.properties.lockstep_core import ALPHABET, SAMPLE, LockstepCore
from kvledger.reference.pages import div_ceil, tokens_to_finish

FRESH = 4  # a token no family or suffix draws (they use 0-3): a prompt of it matches nothing cached


class BoundaryRules(LockstepCore):
    """`squeeze`, `fill_from_cache` and `hit_and_another` (see the module docstring)."""

    def _room(self) -> int:
        """Tokens admission may still reserve: what the pool can give less what running requests hold."""
        return int(self.ref.cm.available_size) - int(self.ref.dm.inflight_tokens)

    def _hit(self, tokens: List[int]) -> int:
        return int(self._do({"op": "probe", "tokens": tokens}).cached_len or 0)

    def _submit(self, tokens: List[int], max_tokens: int) -> bool:
        """Submit when the request is valid here (the trace keeps only valid operations)."""
        total = len(tokens) + max_tokens
        if not tokens or max_tokens < 1 or total > self.header.max_seq_len:
            return False
        if self.optimistic and tokens_to_finish(0, total, self.header.page_size) > self.pool:
            return False
        op: Dict[str, Any] = {"op": "submit", "uid": self.next_uid, "tokens": tokens, "max_tokens": max_tokens}
        self._do(op)
        self.next_uid += 1
        return True

    def _cached(self, tokens: List[int], decodes: int = 0) -> int:
        """The cached prefix of `tokens` (in tokens), caching it first where none is: a request of
        them run to its end leaves its pages in the cache, held by no request; with `decodes` it
        decodes that often first, so the cache holds its prompt and, below it, a node of what it
        generated. A request admission turns away is aborted, so the queue is empty again."""
        hit = self._hit(tokens)
        if hit or self.optimistic or not self._submit(list(tokens), 1 + decodes):
            return hit
        uid = self.next_uid - 1
        self._do({"op": "prefill", "budget": 1024, "sample": [0]})
        if self.ref.waiting:
            self._do({"op": "abort", "uid": uid})
            return 0
        for _ in range(decodes):
            if uid in self.running_uids():
                self._do({"op": "decode", "sample": [0]})
        return self._hit(tokens)

    @precondition(
        lambda self: (
            self.header.cache_type == "radix"
            and not self.optimistic
            and not self.ref.waiting
            and self.ref.tm.available_size > 0
        )
    )
    @rule(family=st.integers(0, 2), keep=st.integers(1, 48), slack=st.integers(0, 1), sample=SAMPLE)
    def squeeze(self, family: int, keep: int, slack: int, sample: List[int]) -> None:
        """Reserve admission at its boundary: a prompt over a cached prefix that no request holds
        (so it counts as evictable), its worst case `slack` pages under what the pool can give
        while that prefix counts. Admission must lock the hit and check again, now that it is not
        evictable: the request is turned away only after locking."""
        tokens = self.families[family % len(self.families)][:keep]
        hit = self._cached(tokens)
        if not hit or self.ref.tm.available_size == 0:
            return
        ps = self.header.page_size
        # the worst case of a request of n tokens in all holds ceil((n - 1) / ps) pages
        pages = self._room() // ps - slack + div_ceil(hit, ps)
        prompt = tokens + [FRESH]  # one token past the hit: admission matches the whole of it
        if self._submit(prompt, pages * ps + 1 - len(prompt)):
            self._do({"op": "prefill", "budget": 1024, "sample": sample})

    @precondition(
        lambda self: (
            self.header.cache_type == "radix"
            and not self.optimistic
            and self.header.page_size > 1
            and not self.ref.waiting
            and self.ref.tm.available_size > 0
        )
    )
    @rule(family=st.integers(0, 2), keep=st.integers(1, 6), shortfall=st.integers(2, 4), sample=SAMPLE)
    def fill_from_cache(self, family: int, keep: int, shortfall: int, sample: List[int]) -> None:
        """A prompt that matches nothing cached and needs `shortfall` pages more than are free:
        its allocation must evict several cached pages at once, the shortfall counted in pages and
        asked of the cache in tokens. Where the radix cache holds nothing, a family's prefix is
        cached first, as two nodes: a prompt a token short of `keep` whole pages, and below it the
        page its one decode completed; an eviction asked for too few tokens stops after that leaf."""
        ps = self.header.page_size
        cache = self.ref.cm.prefix_cache
        if not cache.size_info.evictable_size:
            fam = self.families[family % len(self.families)]
            self._cached((fam + [FRESH + 1] * keep * ps)[: keep * ps - 1], decodes=1)
        if self.ref.waiting or self.ref.tm.available_size == 0:
            return
        free_pages = (int(self.ref.cm.available_size) - int(cache.size_info.evictable_size)) // ps
        length = min(free_pages + shortfall, self._room() // ps) * ps
        if self._submit([FRESH] * length, 1):
            self._do({"op": "prefill", "budget": 1024, "sample": sample})

    @precondition(lambda self: self.header.cache_type == "radix" and not self.ref.waiting)
    @rule(
        family=st.integers(0, 2),
        keep=st.integers(1, 48),
        other=st.lists(ALPHABET, min_size=1, max_size=6),
        extra=st.integers(0, 1),
        sample=SAMPLE,
    )
    def hit_and_another(self, family: int, keep: int, other: List[int], extra: int, sample: List[int]) -> None:
        """Two requests prefill in one step, the first over a cached prefix, with a budget of
        exactly the tokens both compute (plus `extra`): the cached prefix costs no budget, so both
        are admitted whole."""
        tokens = self.families[family % len(self.families)][:keep]
        hit = self._cached(tokens)
        if not hit:
            return
        first = tokens + [FRESH]
        if self._submit(first, 1) and self._submit(list(other), 1):
            budget = len(first) - hit + len(other) + extra
            self._do({"op": "prefill", "budget": budget, "sample": sample})
