"""`SpeculatingCacheScheduler`: the cache scheduler's decode step with speculative decoding, over
`reference` or `fast` (lockstep runs it on both when a trace's header sets `spec_tokens`).

A decode step verifies up to `spec_tokens` drafts after each running request's last token:

  propose   each request takes `min(spec_tokens, Req.draft_room)` drafts (the room keeps every
            accepted draft and the bonus token within max_tokens, so the lookahead stays inside
            the worst case admission reserved); its `device_len` then counts them
  allocate  the pages of positions [cached_len, device_len + drafts), the lookahead, through the
            cache scheduler's own `allocate` (eviction, and under a preempting policy the newest
            live requests preempted until they fit)
  forward   the model writes KV for the last token and every draft (KV provenance records it)
  verify    `accept` (per request with drafts, in batch order, cycled; empty: none) says how many
            drafts the model accepted: those and one bonus token become the request's tokens, KV
            is committed through the last accepted draft (`Req.verify`), and the pages past the
            committed KV's last page go back to the free list (`CacheManager.release_rejected`)
  finish    a request out of room, or named in `stop`, ends as after any decode

The design keeps no over-allocation between operations: rejected pages are released in the step
that rejected them, so between operations a live request holds exactly the pages of its committed
KV, every invariant of `invariants.py` applies unchanged, and finish, abort and preemption have no
lookahead to return. The rejected positions inside the last committed page stay the request's (the
cache never takes them: it takes [0, cached_len)) and its next step writes over them.

Tokens: the step reads `sample` (cycled) as one stream: per request its drafts, then its bonus
token; a bonus equal to the first rejected draft is bumped by one (the model disagrees with it).

Checked here, with arithmetic of its own (11-spec), on top of the judge after the operation:
  lookahead  after allocation, each request's row holds distinct, page-contiguous pages for every
             position of [committed, committed + 1 + drafts), none free, cached or another's
  rollback   after verification, no rejected position's location is in the prefix cache or below
             a live request's committed length, and each page past the committed KV is free again
  pages      after every operation, free + cached + each live request's committed pages past its
             locked prefix count the pool exactly: no reserved page outlives its step

The engine can run the same step: its scheduler would call `Req.propose` with its drafter's tokens
before `allocate`, and after its forward `Req.verify` with what the sampler accepted, then
`CacheManager.release_rejected` (see docs/admission-and-preemption.md).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Dict, List, Sequence, Set, Tuple

from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.engine.ledger.invariants import InvariantViolation, tolist
from kvledger.engine.ledger.ops import InvalidOp, OpResult
from kvledger.reference.events import note
from kvledger.reference.pages import div_ceil

__all__ = ["SPEC_EVENTS", "SpeculatingCacheScheduler"]

# the rare states a speculating run should reach (tests/properties/test_lockstep_speculation.py)
SPEC_EVENTS = frozenset(
    {
        "spec: a draft rejected",
        "spec: every draft accepted",
        "spec: rollback crosses a page boundary",
        "spec: reserve needs a new page on an exhausted pool",
        "spec: drafts cut short by max_tokens",
        "spec: a request with drafts preempted",
        "spec: a request ends on accepted drafts",
    }
)
INVARIANT = "11-spec"
Plan = Tuple[List[int], int]  # a request's drafts and its bonus token, in one step


class SpeculatingCacheScheduler(CacheScheduler):
    """A `CacheScheduler` whose decode verifies drafts (see the module docstring)."""

    speculates = True

    def __init__(self, impl: ModuleType, *, spec_tokens: int, **kwargs: Any) -> None:
        if spec_tokens < 1:
            raise ValueError(f"spec_tokens must be >= 1, got {spec_tokens}")
        super().__init__(impl, **kwargs)
        self.spec_tokens = spec_tokens

    def prefill(
        self, budget: int, sample: Sequence[int] = (), stop: Sequence[int] = (), accept: Sequence[int] = ()
    ) -> OpResult:
        if accept:
            raise InvalidOp("prefill: a request drafts from its first decode on; accept belongs to a decode")
        return super().prefill(budget, sample, stop)

    def decode(self, sample: Sequence[int] = (), stop: Sequence[int] = (), accept: Sequence[int] = ()) -> OpResult:
        if any(a < 0 for a in accept):
            raise InvalidOp(f"decode: accept counts drafts, so none is negative: {list(accept)}")
        batch = list(self.dm.running_reqs)
        self._check_stop_op(self._sampling(batch), stop, "are not running")
        if not batch:
            return OpResult(batch=(), preempted=self._preempted_result([]))
        stream = _Tokens(sample)
        plan: Dict[int, Plan] = {}
        for req in batch:
            k = min(self.spec_tokens, req.draft_room)
            if k < self.spec_tokens:
                note("spec: drafts cut short by max_tokens")
            drafts = stream.take(k)
            plan[req.uid] = (drafts, stream.take(1)[0])
            req.propose(drafts)
        self._note_exhausted(batch)
        ran, preempted = self.allocate(batch)
        if any(plan[uid][0] for uid in preempted if uid in plan):
            note("spec: a request with drafts preempted")
        if ran:
            self._check_lookahead(ran)
            self._verify(ran, plan, accept, [u for u in stop if u not in preempted])
        return OpResult(batch=tuple(r.uid for r in ran), preempted=self._preempted_result(preempted))

    def _note_exhausted(self, batch: List[Any]) -> None:
        ps = self.page_size
        needed = sum(div_ceil(r.device_len, ps) - div_ceil(r.cached_len, ps) for r in batch)
        if needed and not len(self.cm.free_slots) and any(r.drafts for r in batch):
            note("spec: reserve needs a new page on an exhausted pool")

    def _verify(self, batch: List[Any], plan: Dict[int, Plan], accept: Sequence[int], stop: List[int]) -> None:
        """The forward wrote the last token's and every draft's KV; commit what `accept` accepts,
        drop the rest, and end the requests that are done (the base `complete`'s order)."""
        self._check_stop(self._sampling(batch), stop)
        if self.provenance is not None:
            for req in batch:
                tokens = tolist(req.input_ids) + plan[req.uid][0]
                locations = tolist(self.page_table[req.table_idx][req.cached_len : req.device_len])
                self.provenance.written(locations, tokens, req.cached_len)
        rejected: List[Tuple[Any, int, List[int]]] = []  # (request, where its locations ended, rejected ones)
        verified = 0
        for req in batch:
            drafts, bonus = plan[req.uid]
            accepted = 0
            if drafts:
                accepted = min(int(accept[verified % len(accept)]) if accept else 0, len(drafts))
                verified += 1
                note("spec: every draft accepted" if accepted == len(drafts) else "spec: a draft rejected")
                if accepted < len(drafts) and bonus == drafts[accepted]:
                    bonus += 1
            reserved_end = req.verify(accepted, bonus)
            if accepted and not req.can_decode:
                note("spec: a request ends on accepted drafts")
            rejected.append((req, reserved_end, tolist(self.page_table[req.table_idx][req.cached_len : reserved_end])))
        self.dm.filter_reqs(batch)
        if self.after_forward is not None:
            self.after_forward("decode", batch)
        stopping = set(stop)
        with self.cm.lazy_free_region():
            for req, reserved_end, _ in rejected:
                self.cm.release_rejected(req, reserved_end)
            for req in batch:
                if not req.can_decode or req.uid in stopping:
                    self.dm.remove_req(req)
                    self._release(req)
        self._check_rollback(rejected)

    # -- 11-spec: the speculation's own arithmetic ----------------------------------------------
    def _claims(self) -> Tuple[Set[int], Set[int]]:
        ps = self.page_size
        free = set(tolist(self.cm.free_slots))
        cached = {loc for node in self.cm.prefix_cache.nodes() for loc in tolist(node.value)}
        return free, {loc - loc % ps for loc in cached}

    def _check_lookahead(self, batch: List[Any]) -> None:
        ps = self.page_size
        free, cached = self._claims()
        owner: Dict[int, int] = {}
        for req in batch:
            row = tolist(self.page_table[req.table_idx])
            first, end = req.cached_len - req.cached_len % ps, req.device_len
            starts = row[first:end:ps]
            want = div_ceil(end, ps) - first // ps
            for pos in range(first, end):
                if row[pos] != row[pos - pos % ps] + pos % ps:
                    raise InvariantViolation(
                        INVARIANT, f"uid {req.uid}: its lookahead row is not page-contiguous at position {pos}"
                    )
            if len(starts) != want or len(set(starts)) != want:
                raise InvariantViolation(
                    INVARIANT, f"uid {req.uid}: positions [{first}, {end}) hold {len(set(starts))} pages, not {want}"
                )
            for start in starts:
                bad = (
                    "is free"
                    if start in free
                    else "is cached"
                    if start in cached
                    else f"is also uid {owner[start]}'s"
                    if start in owner
                    else None
                )
                if bad is not None:
                    raise InvariantViolation(
                        INVARIANT,
                        f"uid {req.uid}: committed {req.cached_len}, drafts to position {end}: "
                        f"its lookahead page at location {start} {bad}",
                    )
                owner[start] = req.uid

    def _check_rollback(self, rejected: List[Tuple[Any, int, List[int]]]) -> None:
        ps = self.page_size
        free, _ = self._claims()
        cached_locs = {loc for node in self.cm.prefix_cache.nodes() for loc in tolist(node.value)}
        committed = {loc for r in self.live.values() for loc in tolist(self.page_table[r.table_idx][: r.cached_len])}
        for req, _, locations in rejected:
            for i, loc in enumerate(locations):
                pos = req.cached_len + i
                if loc in cached_locs or loc in committed:
                    where = "the prefix cache" if loc in cached_locs else "a live request's committed KV"
                    raise InvariantViolation(
                        INVARIANT, f"uid {req.uid}: rejected position {pos} (location {loc}) is in {where}"
                    )
                if pos >= div_ceil(req.cached_len, ps) * ps and loc - loc % ps not in free:
                    raise InvariantViolation(
                        INVARIANT,
                        f"uid {req.uid}: committed {req.cached_len}, but the page of rejected position {pos} "
                        f"(location {loc}) is not free again",
                    )

    def check(self) -> None:
        super().check()
        ps = self.page_size
        free, _ = self._claims()
        cached = sum(len(tolist(node.value)) for node in self.cm.prefix_cache.nodes()) // ps
        owned = sum(div_ceil(r.cached_len, ps) - r.cache_handle.cached_len // ps for r in self.live.values())
        if len(free) + cached + owned != self.num_pages:
            raise InvariantViolation(
                INVARIANT,
                f"{len(free)} free + {cached} cached + {owned} committed pages of live requests, "
                f"but the pool has {self.num_pages}",
            )


class _Tokens:
    """`sample` read as one stream of tokens (cycled; none: zeros)."""

    def __init__(self, sample: Sequence[int]) -> None:
        self.sample, self.n = [int(t) for t in sample], 0

    def take(self, count: int) -> List[int]:
        out = [self.sample[(self.n + i) % len(self.sample)] if self.sample else 0 for i in range(count)]
        self.n += count
        return out
