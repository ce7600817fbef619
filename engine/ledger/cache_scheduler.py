"""The cache-side scheduler: one implementation (`reference` or `fast`) driven the way the engine
drives it, one typed operation at a time (the operations and their semantics: `ops.py`).

It owns the waiting queue and the implementation's managers (cache, table, decode, preemptor);
the engine runs its model between `allocate` and `complete`, and reads what it needs through the
methods at the end of the class, never the managers. The invariants are judged after every
operation by `check` (`invariants.py`, then the implementation's own integrity check).

Under optimistic admission (`AdmissionPolicy("optimistic")`) a prefill or decode whose pages do
not fit preempts the most recently admitted live requests first (`Preemptor.make_room`, in the
implementation): a victim leaves the running set (or stops mid-chunk) and waits again at the head
of the queue, behind a request still mid-chunk, resuming from its prompt plus its output. Under
`reserve` a step that does not fit is an invariant violation, as it always was.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Dict, List, Sequence, Set, Tuple, Union

from kvledger.engine.ledger.invariants import InvariantViolation, KVProvenance, check_queue_order, judge, tolist
from kvledger.engine.ledger.ops import (
    CacheOp,
    InvalidOp,
    OpResult,
    dispatch,
    parse,
)
from kvledger.engine.ledger.rollback import Checkpoint
from kvledger.reference.admission_policy import RESERVE, AdmissionPolicy, ObservedOutputRatio
from kvledger.reference.events import note
from kvledger.reference.pages import div_ceil, tokens_to_finish

__all__ = ["CacheScheduler", "InvalidOp", "InvariantViolation", "PageStats"]


class CacheScheduler:
    def __init__(
        self,
        impl: ModuleType,
        *,
        num_pages: int,
        page_size: int,
        cache_type: str,
        table_slots: int,
        max_seq_len: int,
        device: str = "cpu",
        check_admission: bool = True,
        increasing_uids: bool = False,
        admission: AdmissionPolicy = RESERVE,
        track_provenance: bool = True,
    ) -> None:
        self.impl = impl
        self.page_size = page_size
        self.num_pages = num_pages
        self.policy = admission
        self.max_seq_len = max_seq_len
        # rows hold whole pages: a request near max_seq_len still fills its last page
        self.page_table = impl.make_page_table(table_slots, div_ceil(max_seq_len, page_size) * page_size, device=device)
        self.cm = impl.CacheManager(num_pages, page_size, self.page_table, cache_type)
        self.tm = impl.TableManager(table_slots, self.page_table)
        self.dm = impl.DecodeManager(page_size, policy=admission)
        self.preemptor = impl.Preemptor(self.cm, self.tm)
        self.preemptions = 0  # requests preempted so far
        self.recomputed_tokens = 0  # KV positions computed again after a preemption (not found in the cache)
        self.prefix_hits: Dict[int, int] = {}  # the last admit's newly admitted uids -> tokens found in the cache
        # uid -> (KV positions it had computed when last preempted, times preempted) while it lives
        self._preempted: Dict[int, tuple[int, int]] = {}
        # adaptive admission: the ratio follows what ended requests generated (uid -> prompt length)
        self.observed_ratio = ObservedOutputRatio(admission.reserve_ratio) if admission.kind == "adaptive" else None
        self._prompt_len: Dict[int, int] = {}
        # queue order (invariant 10): uid -> its submission's number, and its latest admission's
        self._arrival: Dict[int, int] = {}
        self._admitted_at: Dict[int, int] = {}
        self._admissions = 0
        self._submissions = 0
        self.waiting: List[Any] = []
        self.live: Dict[int, Any] = {}  # uid -> admitted request (running or mid-chunk)
        self.known: Set[int] = set()
        # uid -> (prompt, max_tokens) while it lives: what the invariants judge requests against
        self.submitted: Dict[int, tuple[tuple[int, ...], int]] = {}
        # what each KV location encodes (invariant 7); the engine's own ledger turns it off: its
        # sampled tokens are placeholders until they land, and its --verify shadow tracks it instead
        self.provenance = KVProvenance() if track_provenance else None
        # a long-running engine must not remember every uid: it submits increasing uids instead,
        # and only the largest one is kept (a trace it records replays under either rule)
        self.increasing_uids = increasing_uids
        self.last_uid: int | None = None
        # invariant 4 (a turned-away request changes nothing) costs a snapshot of the free list and
        # every cached page per admission attempt: the engine turns it off (its --verify mirrors
        # every operation into a reference cache scheduler that checks it)
        self.check_admission = check_admission
        # called after a batch's forward, before its results are processed (as the seed's table prints)
        self.after_forward: Callable[[str, List[Any]], None] | None = None

    def is_chunked(self, req: Any) -> bool:
        """Whether `req` is mid-prefill (its next chunk still to come): it samples no token."""
        return isinstance(req, self.impl.ChunkedReq)

    def sampled_rows(self, batch: Sequence[Any]) -> List[int]:
        """The batch indices of the requests that sample a token (not mid-prefill)."""
        chunked = self.impl.ChunkedReq  # is_chunked, inlined: it runs for every row of every step
        return [i for i, r in enumerate(batch) if not isinstance(r, chunked)]

    # -- operations ---------------------------------------------------------------------------
    def submit(self, uid: int, tokens: Sequence[int], max_tokens: int) -> OpResult:
        if uid in self.known or (self.increasing_uids and self.last_uid is not None and uid <= self.last_uid):
            raise InvalidOp(
                f"submit: uid {uid} was already submitted"
                + (f" (uids must increase; the last was {self.last_uid})" if self.increasing_uids else "")
            )
        if len(tokens) + max_tokens > self.max_seq_len:
            raise InvalidOp(
                f"submit: uid {uid} needs {len(tokens) + max_tokens} positions, max_seq_len is {self.max_seq_len}"
            )
        worst, pool = tokens_to_finish(0, len(tokens) + max_tokens, self.page_size), self.num_pages * self.page_size
        if self.policy.preempts and worst > pool:  # preemption could never make it fit
            raise InvalidOp(f"submit: uid {uid} may need {worst} tokens of KV, the pool holds {pool}")
        params = self.impl.SamplingParams(max_tokens=max_tokens)
        try:
            pending = self.impl.PendingReq(uid, list(tokens), params)
        except ValueError as e:
            raise InvalidOp(f"submit: {e}") from None
        if not self.increasing_uids:
            self.known.add(uid)
        self.last_uid = uid if self.last_uid is None else max(self.last_uid, uid)
        self.submitted[uid] = (tuple(map(int, tokens)), max_tokens)
        self._arrival[uid] = self._submissions
        self._submissions += 1
        if self.observed_ratio is not None:
            self._prompt_len[uid] = len(tokens)
        self.waiting.append(pending)
        return OpResult()

    def prefill(self, budget: int, sample: Sequence[int] = (), stop: Sequence[int] = ()) -> OpResult:
        self._check_stop_op([p.uid for p in self.waiting], stop, "are not waiting")
        # Whether a waiting request named in `stop` samples (admitted whole, not turned away or
        # left mid-chunk) is known only once admission has locked, split, stamped and taken table
        # slots: a refusal then rolls all of it back, since a refused operation leaves no trace.
        checkpoint = self._checkpoint() if stop else None
        batch, rejected = self.admit(budget)
        try:
            self._check_stop(self._sampling(batch), stop)
        except InvalidOp:
            if checkpoint is not None:
                checkpoint.restore()
            raise
        batch, preempted = self._run(batch, sample, stop, is_prefill=True)
        return OpResult(batch=_uids(batch), refused=rejected, preempted=self._preempted_result(preempted))

    def decode(self, sample: Sequence[int] = (), stop: Sequence[int] = ()) -> OpResult:
        batch = list(self.dm.running_reqs)
        # before allocating or preempting: a bad stop takes no page
        self._check_stop_op(self._sampling(batch), stop, "are not running")
        batch, preempted = self._run(batch, sample, stop, is_prefill=False)
        return OpResult(batch=_uids(batch), preempted=self._preempted_result(preempted))

    def _checkpoint(self) -> Checkpoint:
        # Left out: what is not state, and what admission does not write but for rows of the
        # table slots it takes (a slot freed by the rollback is read by nobody until reused).
        return Checkpoint(
            self, keep=(self.impl, self.after_forward, self.page_table, self.tm.token_pool, self.provenance)
        )

    def _preempted_result(self, preempted: List[int]) -> Tuple[int, ...] | None:
        return tuple(preempted) if self.policy.preempts else None

    def admit(self, budget: int) -> tuple[List[Any], int | None]:
        """Admit from the head of the queue within `budget` tokens until one does not fit.
        Returns the prefill batch (requests mid-chunk go back to the queue front) and the uid
        of the request that was turned away, if any."""
        if budget < 1:
            raise InvalidOp(f"prefill: budget must be >= 1, got {budget}")
        adder = self.impl.PrefillAdder(budget, self.dm.inflight_tokens, self.cm, self.tm, policy=self.policy)
        batch = []
        rejected = None
        self.prefix_hits = {}
        for pending in self.waiting:
            fresh = pending.chunked_req is None
            before = self._admission_state() if self.check_admission and fresh else None
            req = adder.try_add_one(pending)
            if req is None:
                if before is not None and adder.token_budget > 0:
                    rejected = pending.uid
                    if self._admission_state() != before:
                        raise InvariantViolation(
                            "4-failed-admission", f"rejecting uid {pending.uid} changed locks, free list or table slots"
                        )
                break
            pending.chunked_req = req if self.is_chunked(req) else None
            if fresh:
                self.prefix_hits[req.uid] = req.cached_len
                self._admitted_at[req.uid] = self._admissions
                self._admissions += 1
            if fresh and req.uid in self._preempted:
                self._readmitted(req)
            batch.append(req)
        self.waiting = [p for p in self.waiting[: len(batch)] if p.chunked_req is not None] + self.waiting[len(batch) :]
        for req in batch:
            self.live[req.uid] = req
        return batch, rejected

    def _readmitted(self, req: Any) -> None:
        computed, times = self._preempted[req.uid]
        self._preempted[req.uid] = (0, times)
        self.recomputed_tokens += max(computed - req.cached_len, 0)
        if req.cached_len > 0:
            note("preempt: re-prefill hits the prefix cache")

    def finish(self, uid: int) -> OpResult:
        req = self.dm.running_reqs.get(uid)
        if req is None:
            raise InvalidOp(f"finish: uid {uid} is not running")
        with self.cm.lazy_free_region():
            self.dm.remove_req(req)
            self._release(req)
        return OpResult()

    def abort(self, uid: int) -> OpResult:
        for i, pending in enumerate(self.waiting):
            if pending.uid == uid:
                del self.waiting[i]
                if pending.chunked_req is not None:
                    self._release(pending.chunked_req)
                if self._preempted.pop(uid, None) is not None:
                    note("preempt: a preempted request aborted while waiting")
                self._prompt_len.pop(uid, None)
                self.submitted.pop(uid, None)
                self._arrival.pop(uid, None)
                self._admitted_at.pop(uid, None)
                return OpResult(where="waiting")
        req = self.dm.running_reqs.get(uid)
        if req is None:
            raise InvalidOp(f"abort: uid {uid} is neither waiting nor running")
        self.dm.remove_req(req)
        self._release(req)
        return OpResult(where="running")

    def evict(self, tokens: int) -> OpResult:
        evictable = self.cm.prefix_cache.size_info.evictable_size
        if not 0 <= tokens <= evictable:
            raise InvalidOp(f"evict: {tokens} tokens asked, {evictable} evictable")
        return OpResult(evicted=tuple(tolist(self.cm.evict(tokens))))

    def probe(self, tokens: Sequence[int]) -> OpResult:
        pending = self.impl.PendingReq(-1, list(tokens) + [0], self.impl.SamplingParams(max_tokens=1))
        handle = self.cm.match_req(pending).cuda_handle
        self.cm.lock(handle)
        locked_available = self.cm.available_size
        self.cm.unlock(handle)
        return OpResult(
            cached_len=handle.cached_len,
            indices=tuple(tolist(handle.get_matched_indices())),
            locked_available=locked_available,
        )

    def apply(self, op: Union[Dict[str, Any], CacheOp]) -> OpResult:
        """Apply one operation, typed or as its trace line (checked by `ops.parse`)."""
        return dispatch(parse(op) if isinstance(op, dict) else op, self)

    # -- one step: admit or pick the decode batch, allocate, (the model runs), complete ------
    def _run(
        self, batch: List[Any], sample: Sequence[int], stop: Sequence[int], is_prefill: bool
    ) -> tuple[List[Any], List[int]]:
        if not batch:
            return [], []
        batch, preempted = self.allocate(batch)
        if batch:
            # a request this step preempted samples no token, so no token of its can stop it
            self.complete(batch, sample, [u for u in stop if u not in preempted], is_prefill)
        return batch, preempted

    def _sampling(self, batch: List[Any]) -> List[int]:
        chunked = self.impl.ChunkedReq
        return [r.uid for r in batch if not isinstance(r, chunked)]

    def _check_stop_op(self, allowed: Sequence[int], stop: Sequence[int], why: str) -> None:
        """A prefill's or decode's `stop`, before the operation changes anything."""
        if len(set(stop)) < len(stop):
            raise InvalidOp(f"stop names a uid twice: {list(stop)}")
        self._check_stop(allowed, stop, why)

    def _check_stop(
        self, allowed: Sequence[int], stop: Sequence[int], why: str = "sampled no token in this batch"
    ) -> None:
        bad = set(stop) - set(allowed)
        if bad:
            raise InvalidOp(f"stop names uids {sorted(bad)} that {why}")

    def allocate(self, batch: List[Any]) -> tuple[List[Any], List[int]]:
        """Give the step its pages. Under optimistic admission, first preempt the newest live
        requests until they fit. Returns the batch that runs and the uids preempted, in order."""
        victims: List[Any] = []
        if self.policy.preempts:
            live = list(self.live.values())
            try:
                victims = self.preemptor.make_room(batch, live)
            except RuntimeError as e:
                raise InvariantViolation(
                    "3-no-oom", f"preemption could not make room for uids {[r.uid for r in batch]}: {e}"
                ) from e
            uids = [v.uid for v in victims]
            newest = [r.uid for r in live[::-1][: len(victims)]]
            if uids != newest:
                raise InvariantViolation(
                    "6-preemption-order", f"preempted uids {uids}, but the newest live requests are {newest}"
                )
            for victim in victims:
                self._requeue(victim)
            gone = set(uids)
            batch = [r for r in batch if r.uid not in gone]
        try:
            self.cm.allocate_paged(batch)
        except Exception as e:  # a running request found no memory: the promise broke
            raise InvariantViolation("3-no-oom", f"allocation failed for uids {[r.uid for r in batch]}: {e}") from e
        return batch, [v.uid for v in victims]

    def _requeue(self, victim: Any) -> None:
        """A victim waits again: mid-chunk, in its own queue entry; otherwise at the queue head,
        behind the request mid-chunk (that one is older, and holds pages it needs to finish)."""
        del self.live[victim.uid]
        self.dm.remove_req(victim)
        self.preemptions += 1
        times = self._preempted.get(victim.uid, (0, 0))[1] + 1
        self._preempted[victim.uid] = (victim.cached_len, times)
        if times == 2:
            note("preempt: the same request preempted twice")
        for pending in self.waiting:
            if pending.chunked_req is victim:
                pending.chunked_req = None
                return
        head = 1 if self.waiting and self.waiting[0].chunked_req is not None else 0
        self.waiting.insert(head, self.preemptor.resumed(victim))

    def complete(self, batch: List[Any], sample: Sequence[int], stop: Sequence[int], is_prefill: bool) -> None:
        """After the forward: every request computed its tokens; the sampled ones get their token
        (`sample`, in batch order, cycled); those that reached max_tokens or are in `stop` (EOS)
        finish, in one lazy-free region; a prefill hands its prompt KV to the prefix cache."""
        if stop:  # no stop names no uid outside the batch
            self._check_stop(self._sampling(batch), stop)
        stopping = set(stop)
        if self.provenance is not None:  # the forward pass filled positions [cached_len, device_len)
            for req in batch:
                locations = tolist(self.page_table[req.table_idx][req.cached_len : req.device_len])
                self.provenance.written(locations, tolist(req.input_ids), req.cached_len)
        for req in batch:
            req.complete_one()
        self.dm.filter_reqs(batch)
        if self.after_forward is not None:
            self.after_forward("prefill" if is_prefill else "decode", batch)
        chunked, n = self.impl.ChunkedReq, len(sample)
        with self.cm.lazy_free_region():
            for i, req in enumerate(batch):
                if isinstance(req, chunked):  # is_chunked, inlined
                    continue
                req.append_host(int(sample[i % n]) if n else 0)
                if not req.can_decode or req.uid in stopping:
                    self.dm.remove_req(req)
                    self._release(req)
                elif is_prefill:
                    self.cm.cache_req(req, finished=False)

    def _release(self, req: Any) -> None:
        self.tm.free(req.table_idx)
        self.cm.cache_req(req, finished=True)
        self.live.pop(req.uid, None)
        self._preempted.pop(req.uid, None)
        self.submitted.pop(req.uid, None)
        self._arrival.pop(req.uid, None)
        self._admitted_at.pop(req.uid, None)
        prompt_len = self._prompt_len.pop(req.uid, None)
        if prompt_len is not None and self.observed_ratio is not None and not self.is_chunked(req):
            self._observe_output(self.observed_ratio, len(req.input_ids) - prompt_len, req.max_device_len - prompt_len)

    def forget_observed_outputs(self) -> None:
        """Adaptive admission starts over from the configured ratio (after a benchmark's warm-up)."""
        if self.observed_ratio is not None:
            initial = self.observed_ratio.initial
            self.observed_ratio = ObservedOutputRatio(initial)
            self.policy = self.dm.policy = self.policy.with_ratio(initial)

    def _observe_output(self, observed: ObservedOutputRatio, generated: int, max_tokens: int) -> None:
        ratio = observed.observe(generated, max_tokens)
        if ratio != self.policy.reserve_ratio:
            note("adaptive: the reserve ratio changed")
            self.policy = self.policy.with_ratio(ratio)
            self.dm.policy = self.policy

    # -- observation --------------------------------------------------------------------------
    def _admission_state(self) -> Tuple[List[int], List[Tuple[int, int]], List[int], Tuple[int, ...]]:
        # per cached page, not per node: a match may split a node, which moves no page and no lock
        ps = self.page_size
        locks = sorted(
            (loc, node.ref_count) for node in self.cm.prefix_cache.nodes() for loc in tolist(node.value)[::ps]
        )
        return (tolist(self.cm.free_slots), locks, self.tm.free_slots(), tuple(self.cm.prefix_cache.size_info))

    def snapshot(self) -> Dict[str, Any]:
        ps = self.page_size
        live = list(self.live.values())
        return {
            "free_slots": tolist(self.cm.free_slots),
            "owners": sorted(self.cm.page_owners(live).items()),
            "rows": {r.uid: tolist(self.page_table[r.table_idx][: div_ceil(r.cached_len, ps) * ps]) for r in live},
            "lens": {r.uid: (r.table_idx, r.cached_len, r.device_len, r.cache_handle.cached_len) for r in live},
            "token_pool": {
                r.uid: tolist(self.tm.token_pool[r.table_idx][: r.max_device_len - r.output_len]) for r in live
            },
            "available_size": self.cm.available_size,
            "size_info": tuple(self.cm.prefix_cache.size_info),
            "table_free": self.tm.free_slots(),
            "waiting": [(p.uid, p.input_len, p.output_len) for p in self.waiting],
            "running": self.dm.running_reqs.uids(),
            "inflight_tokens": self.dm.inflight_tokens,
            "preemptions": self.preemptions,
            "reserve_ratio": self.policy.reserve_ratio,
            # what the engine reads (last: it follows from the state above), so both sides answer alike
            "engine_reads": (
                self.page_stats(),
                self.next_uid(),
                self.queue_length(),
                self.has_runnable(),
                [r.uid for r in self.running_requests()],
                sorted(self.admission_hits().items()),
                self.preempts,
                [self.is_running(r.uid) for r in live],
                [self.waiting_request(p.uid) is p for p in self.waiting],
            ),
        }

    def check(self) -> None:
        """The invariants on this implementation alone: the judge (`invariants.py`), from first
        principles, then the implementation's own integrity check (structure it alone knows)."""
        judge(self)
        check_queue_order([p.uid for p in self.waiting], self._arrival, self._admitted_at, self._preempted, self.live)
        try:
            self.cm.check_integrity(list(self.live.values()))
        except RuntimeError as e:
            raise InvariantViolation("1-2-partition", str(e)) from e

    # -- what the engine reads (it never reaches into the managers) ----------------------------
    @property
    def preempts(self) -> bool:
        """Whether a step that does not fit preempts (optimistic or adaptive admission)."""
        return self.policy.preempts

    def running_requests(self) -> List[Any]:
        """The requests that decode in the next decode step, in admission order."""
        return list(self.dm.running_reqs)

    def is_running(self, uid: int) -> bool:
        return self.dm.running_reqs.get(uid) is not None

    def has_runnable(self) -> bool:
        """Whether a decode step has anything to run."""
        return bool(self.dm.runnable)

    def evictable_tokens(self) -> int:
        """Tokens in the prefix cache that no request holds (what `evict` may take at most)."""
        return int(self.cm.prefix_cache.size_info.evictable_size)

    def queue_length(self) -> int:
        """Requests submitted and not admitted yet (preempted ones included)."""
        return len(self.waiting)

    def waiting_request(self, uid: int) -> Any | None:
        return next((p for p in self.waiting if p.uid == uid), None)

    def admission_hits(self) -> Dict[int, int]:
        """The last admission's newly admitted uids -> prompt tokens found in the prefix cache."""
        return dict(self.prefix_hits)

    def next_uid(self) -> int:
        """The smallest uid a submit may use next under increasing uids."""
        return 0 if self.last_uid is None else self.last_uid + 1

    def page_stats(self) -> PageStats:
        ps = self.page_size
        size = self.cm.prefix_cache.size_info
        free = len(self.cm.free_slots)
        cached = div_ceil(size.total_size, ps)
        return PageStats(self.num_pages, free, cached, self.num_pages - free - cached, size.protected_size)


def _uids(batch: List[Any]) -> Tuple[int, ...]:
    return tuple(r.uid for r in batch)


@dataclass(frozen=True)
class PageStats:
    """The pool in pages: free, in the prefix cache, owned by live requests; and cached tokens
    locked by live requests (zero whenever nothing runs)."""

    total: int
    free: int
    cached: int
    owned: int
    locked_tokens: int
