"""Judge mode: drive one subject the way a serving scheduler does, and judge it after every operation.

The driver plays the scheduler around the subject's cache: it owns the waiting queue (first come,
first served; a preempted request rejoins at the head), the token budget, sampling and stops,
and talks to the subject only through the protocol (`properties/subject.py`). It interprets the
cache scheduler's operations (`engine/ledger/ops.py`), so a subject's run is a trace like any
other: submit, prefill(budget, sample, stop), decode(sample, stop), finish, abort, evict.

A step: prefill walks the queue from its head; a request mid-prefill gets its next chunk, a new
one is admitted (`admit`: its hit, or a refusal that ends the walk); each gets
`allocate(uid, computed, computed + chunk)`; then `computed` for each in batch order, with its
sampled token once its prompt is done; then `finish` for those that reached max_tokens or a stop.
Decode allocates one position per running request (in admission order), then the same.
When an allocation finds no room, a subject that preempts gives up its newest live request, or
the one it names (`victim`, capability `chooses_victim`); the victim waits again at the head of
the queue, behind requests mid-prefill and ordered among the other victims by admission, and the
allocation is retried; for a subject that promises worst-case admission it is a finding (3-no-oom).

A refused admission must leave the subject as it was (4-failed-admission), except, for a subject
that `evicts_before_admit`, cached prefixes nobody holds evicted on the way (`subject_state_diff`
says what else changed). A subject that `preempt_keeps_pages` may hold a victim's pages until it
is admitted again or dropped: the driver tells the judge which uids are preempted and waiting
(`Witness.preempted`).

Every finding is a `Finding` (`engine/ledger/finding.py`): an invariant the judge
(`properties/subject_judge.py`) or the driver found broken, or `subject-raised:X`, an exception
out of the subject, with its traceback.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Set, Tuple, cast

from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.invariants import InvariantViolation, check_queue_order
from kvledger.engine.ledger.ops import InvalidOp, OpRecord, OpResult, TraceLine, as_record, dispatch
from kvledger.engine.ledger.trace import Header
from kvledger.properties import write_ahead
from kvledger.properties.subject import GroupView, Subject, SubjectConfig, View, header_of
from kvledger.properties.subject_calls import call_subject, raised
from kvledger.properties.subject_events import (
    ABORT_AFTER_CHECKPOINT,
    EXHAUSTED_AT_DECODE,
    expected_events,
    full_with_locks,
    hit_events,
    pool_exhausted,
    published_own_chunk,
)
from kvledger.properties.subject_judge import Witness, judge
from kvledger.reference.pages import div_ceil

__all__ = ["Finding", "InvalidOp", "SubjectDriver", "expected_events"]


class SubjectDriver:
    def __init__(
        self,
        subject: Subject,
        config: SubjectConfig,
        *,
        check: bool = True,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.subject = subject
        self.config = config
        self.caps = subject.capabilities
        self.check = check
        self.witness = Witness()
        self.max_tokens: Dict[int, int] = {}
        self.waiting: List[int] = []  # head first; a request mid-prefill stays here
        self.running: List[int] = []  # admission order
        self.live: Set[int] = set()  # admitted (running or mid-prefill)
        self.known: Set[int] = set()
        self.arrival: Dict[int, int] = {}
        self.admitted: Dict[int, int] = {}  # uid -> the order number of its latest admission
        self.admissions = 0
        self.preempted: Set[int] = set()
        self.preempted_this_step = False
        self.victims: List[int] = []  # preempted in this step, in order
        self.hits: Dict[int, int] = {}  # uid -> the prefix hit of its latest admission
        self.fit_alone: Set[int] = set()  # admitted once with no prefix hit: the pool held all it needed
        self.on_event = on_event or (lambda name: None)
        self.ops = 0
        self.history: List[OpRecord] = []  # the operations applied (the write-ahead record's prior)

    @property
    def speculates(self) -> bool:
        """A decode verifies drafts (capability spec_tokens): `subject_speculation.py` drives it."""
        return self.caps.spec_tokens > 0

    def view(self) -> View:
        view: View = call_subject("view", self.subject.view)
        return view

    # -- operations ------------------------------------------------------------------------------
    def apply(self, line: TraceLine) -> OpResult:
        """Apply one operation (its `expect`, if any, is the lockstep driver's to check: a subject
        is judged, not compared with a recorded result)."""
        record = as_record(line)
        result = write_ahead.recorded(self, self._pool_header, self.history, record, lambda: dispatch(record.op, self))
        self.ops += 1
        reached = getattr(self.subject, "reached", None)  # rare states a subject reports (its `rare_events`)
        while reached:
            self.on_event(reached.pop(0))
        if self.check:
            self.judge()
        return result

    def _pool_header(self) -> Header:
        return header_of(self.config, None, "kvledger", getattr(self.subject, "name", "subject"), "")

    def judge(self) -> None:
        view = self.view()
        self.witness.preempted = self.preempted - self.live  # preempted, not admitted again since
        try:
            if self.caps.max_ahead:
                from kvledger.properties.subject_speculation import check_tail  # only a subject holding slots ahead

                check_tail(view, self.witness.computed)
            judge(view, self.caps, self.witness, self.subject)
            check_queue_order(
                self.waiting, self.arrival, self.admitted, self.preempted, self.live, self.caps.resume_order
            )
        except InvariantViolation as e:
            raise Finding(e.invariant, str(e).split("] ", 1)[-1]) from e
        except Finding:
            raise
        except Exception as e:  # cache_key is the subject's own code
            raise raised(e, "while judging") from e
        if not self.live and not self.waiting and self.ops and self.known:
            self.on_event("driver: idle after work")

    def submit(self, uid: int, tokens: Sequence[int], max_tokens: int) -> OpResult:
        # at its peak a request holds its last token's page, or up to max_ahead positions past it
        pages = div_ceil(len(tokens) + max_tokens - 1 + self.caps.max_ahead, self.caps.page_size) if tokens else 0
        check_submit(uid, tokens, max_tokens, self.known, self.config, pages)
        call_subject("submit", self.subject.submit, uid, list(tokens), max_tokens)
        self.known.add(uid)
        self.arrival[uid] = len(self.arrival)
        self.witness.tokens[uid] = list(tokens)
        self.witness.prompt_len[uid] = len(tokens)
        self.max_tokens[uid] = max_tokens
        self.waiting.append(uid)
        return OpResult()

    def prefill(
        self, budget: int, sample: Sequence[int] = (), stop: Sequence[int] = (), accept: Sequence[int] = ()
    ) -> OpResult:
        if accept:
            raise InvalidOp("prefill: drafts are verified at decode steps only (accept is for decode)")
        if budget < 1:
            raise InvalidOp(f"prefill: budget must be >= 1, got {budget}")
        if len(set(stop)) < len(stop) or set(stop) - set(self.waiting):
            raise InvalidOp(f"prefill: stop {list(stop)} must name waiting uids, each once")
        batch: List[tuple[int, int, int]] = []  # (uid, start, end)
        left, refused = budget, None
        self.preempted_this_step = False
        self.victims = []
        for uid in list(self.waiting):
            if left <= 0:
                break
            if uid not in self.live:
                if self.preempted_this_step:  # a step that preempted admits nobody (vLLM's schedule)
                    break
                if (not self.caps.chunked_prefill or self.caps.chunk_only_first and batch) and self._needs(uid) > left:
                    break
                hit = self._admit(uid, left)
                if hit is None:
                    refused = uid
                    break
            start = self.witness.computed[uid]
            end = start + min(len(self.witness.tokens[uid]) - start, left)
            if not self._allocate(uid, start, end):
                break
            if uid not in self.live:  # preempted while making room for itself
                break
            left -= end - start
            batch.append((uid, start, end))
            if end < len(self.witness.tokens[uid]):
                self.on_event("prefill: chunked")
                break
        batch = [(u, a, b) for u, a, b in batch if u in self.live]  # a later allocation preempted it
        self._complete(batch, sample, stop, prefill=True)
        return OpResult(batch=tuple(u for u, _, _ in batch), refused=refused, preempted=self._victims())

    def decode(self, sample: Sequence[int] = (), stop: Sequence[int] = (), accept: Sequence[int] = ()) -> OpResult:
        if len(set(stop)) < len(stop) or set(stop) - set(self.running):
            raise InvalidOp(f"decode: stop {list(stop)} must name running uids, each once")
        if self.speculates:
            from kvledger.properties.subject_speculation import speculative_decode  # only a subject that speculates

            return speculative_decode(self, sample, stop, accept)
        if accept:
            raise InvalidOp(f"decode: accept is for a subject that speculates, not {self.subject.name}")
        batch: List[tuple[int, int, int]] = []
        self.victims = []
        ps = self.caps.page_size
        if self.check and any(len(self.witness.tokens[u]) % ps == 1 % ps for u in self.running):
            if pool_exhausted(self.view(), ps):  # a decode that needs a page where none is free or evictable
                self.on_event(EXHAUSTED_AT_DECODE)
        for uid in list(self.running):
            if uid not in self.running:  # preempted by an earlier request's allocation
                continue
            n = len(self.witness.tokens[uid])
            if self._allocate(uid, n - 1, n) and uid in self.running:
                batch.append((uid, n - 1, n))
        batch = [(u, a, b) for u, a, b in batch if u in self.running]
        self._complete(batch, sample, stop, prefill=False)
        return OpResult(batch=tuple(u for u, _, _ in batch), preempted=self._victims())

    def finish(self, uid: int) -> OpResult:
        if uid not in self.running:
            raise InvalidOp(f"finish: uid {uid} is not running")
        self._end(uid)
        return OpResult()

    def abort(self, uid: int) -> OpResult:
        if uid not in self.waiting and uid not in self.running:
            raise InvalidOp(f"abort: uid {uid} is neither waiting nor running")
        if uid in self.waiting and uid in self.live:
            self.on_event("abort: mid-prefill")
            if self.check and published_own_chunk(self.view(), uid, self.hits[uid], self.witness.computed[uid]):
                self.on_event(ABORT_AFTER_CHECKPOINT)
        if uid in self.preempted and uid not in self.live and self.caps.preempt_keeps_pages:
            self.on_event("abort: a preempted request keeping pages")
        self._release("abort", uid)
        self._forget(uid)
        return OpResult()

    def evict(self, tokens: int) -> OpResult:
        if not self.caps.explicit_evict:
            raise InvalidOp(f"evict: {self.subject.name} has no explicit eviction")
        if tokens < 0:
            raise InvalidOp(f"evict: tokens must be >= 0, got {tokens}")
        own = 1 if self.caps.cache_holds_reference else 0  # the lock of an entry nobody uses
        evictable = sum(len(e.locations) for e in self.view().cached if not e.lock or e.lock == own)
        if tokens > evictable:
            raise InvalidOp(f"evict: {tokens} tokens asked, {evictable} evictable")
        return OpResult(evicted_tokens=call_subject("evict", self.subject.evict, tokens))

    def probe(self, tokens: Sequence[int]) -> OpResult:
        raise InvalidOp("probe: not an operation a subject is driven with")

    # -- the parts of a step -----------------------------------------------------------------------
    def _needs(self, uid: int) -> int:
        return len(self.witness.tokens[uid])  # an upper bound before the hit is known

    def _admit(self, uid: int, budget: int) -> int | None:
        before = self.view() if self.check else None
        hit = call_subject("admit", self.subject.admit, uid, budget)
        if hit is None:
            self.on_event("admission: refused")
            after = self.view() if before is not None else None
            if before is not None and after is not None and _state(after) != _state(before):
                from kvledger.properties.subject_state_diff import refusal_finding  # only on this path

                finding = refusal_finding(uid, before, after, self.caps)
                if finding is not None:
                    raise finding
                self.on_event("admission: evicted, then refused")
            return None
        tokens = self.witness.tokens[uid]
        if not isinstance(hit, int) or not 0 <= hit < len(tokens):
            raise Finding(
                "8-request",
                f"uid {uid} was admitted with a hit of {hit!r} tokens, but its prompt "
                f"has {len(tokens)}: a hit must leave the last prompt token to compute",
            )
        # KV a subject copied into the hit from a tier of its own (SGLang's host cache), as its KV
        # buffer holds it: (location, hash of the prefix it encodes, that prefix's length)
        landed = getattr(self.subject, "landed", None)
        while landed:
            location, prefix_hash, length = landed.pop()
            self.witness.written[int(location)] = (int(prefix_hash), int(length))
        if hit and before is not None:
            mid_prefill = {u for u in self.live if u in self.waiting and u != uid}
            for event in hit_events(uid, hit, before, self.view(), self.witness, mid_prefill, self.caps.page_size):
                self.on_event(event)
            if uid in before.preempted:
                self.on_event("admission: resumed on the pages it kept")
            if before.groups:  # KV groups past the first: the hit's window (group_writes.py)
                from kvledger.properties.group_writes import hit_step

                hit_step(uid, hit, self.view(), self.on_event)
        self.live.add(uid)
        self.admitted[uid] = self.admissions  # the newest admission is the first victim, as running[-1] is
        self.admissions += 1
        self.witness.computed[uid] = hit
        self.hits[uid] = hit  # its latest admission's
        if not hit:
            self.fit_alone.add(uid)
        return hit

    def _allocate(self, uid: int, start: int, end: int) -> bool:
        """Locations for [start, end) of `uid`, preempting the newest live request while the
        subject preempts and finds no room. False: nothing allocated (the request does not run)."""
        while True:
            before = self.view() if self.check else None
            if call_subject("allocate", self.subject.allocate, uid, start, end):
                if before is not None and full_with_locks(before, self.caps.page_size):
                    self.on_event("allocate: full pool with locked entries")
                return True
            if self.caps.worst_case_admission:
                raise Finding(
                    "3-no-oom",
                    f"{self.subject.name} refused positions [{start}, {end}) to admitted uid "
                    f"{uid}, but it promises worst-case admission",
                )
            if not self.caps.preempts:
                return False
            victim = self._victim(uid) if self.caps.chooses_victim else self._newest()
            self._preempt(victim)
            if victim == uid:
                return False

    def _newest(self) -> int:
        return max(self.live, key=lambda u: self.admitted[u])

    def _victim(self, uid: int) -> int:
        """The live request the subject gives up so that `uid`'s allocation may find room."""
        victim: int = call_subject("victim", cast(Any, self.subject).victim, uid)
        _check_victim(self.subject.name, uid, victim, self.live)
        if victim != self._newest():
            self.on_event("preempt: the subject chose a victim other than the newest")
        return victim

    def _victims(self) -> tuple[int, ...] | None:
        return tuple(self.victims) if self.caps.preempts else None

    def _preempt(self, uid: int) -> None:
        self.on_event("preempt: a running request preempted")
        self.victims.append(uid)
        self._release("preempt", uid)
        self.live.discard(uid)
        self.witness.computed.pop(uid, None)
        if uid in self.running:
            self.running.remove(uid)
        if uid in self.waiting:
            self.waiting.remove(uid)
        self.waiting.insert(_resume_place(self.waiting, self.live, self.admitted, self.arrival, uid), uid)
        self.preempted.add(uid)
        self.preempted_this_step = True

    def _complete(
        self, batch: List[tuple[int, int, int]], sample: Sequence[int], stop: Sequence[int], prefill: bool
    ) -> None:
        row_of: Dict[int, List[int]] = {}
        rows = View(free=[], requests={})  # the batch's rows in every KV group, read before `computed` is called
        if batch:
            view = self.view()
            row_of = {uid: list(view.requests.get(uid, [])) for uid, _, _ in batch}
            groups = [
                GroupView(g.name, g.window, {u: list(g.requests.get(u, [])) for u in row_of}) for g in view.groups
            ]
            rows = View(free=[], requests=row_of, groups=groups)
            if groups:  # what the forward pass reads in a window group (group_writes.py)
                from kvledger.properties.group_writes import window_step

                window_step(rows, self.witness, batch, self.on_event)
        sampled = 0
        ending: List[int] = []
        for uid, start, end in batch:
            tokens = self.witness.tokens[uid]
            row = row_of[uid]
            if len(row) < end:
                raise Finding(
                    "8-request",
                    f"uid {uid} was allocated positions [{start}, {end}) but the subject "
                    f"shows locations for {len(row)}",
                )
            token = None
            if end == len(tokens):
                token = int(sample[sampled % len(sample)]) if sample else 0
                sampled += 1
            call_subject("computed", self.subject.computed, uid, start, end, token)
            self.witness.wrote_view(rows, uid, tokens, start, end)
            self.witness.computed[uid] = end
            if token is None:
                continue
            tokens.append(token)
            if prefill:
                self.waiting.remove(uid)
                self.running.append(uid)
            generated = len(tokens) - self.witness.prompt_len[uid]
            if generated >= self.max_tokens[uid] or uid in stop:
                ending.append(uid)
        for uid in ending:
            self._end(uid)

    def _end(self, uid: int) -> None:
        self._release("finish", uid)
        self._forget(uid)

    def _release(self, what: str, uid: int) -> None:
        """The subject's `what` (finish, abort, preempt) of `uid`; for a subject that holds slots
        ahead of its tokens, the judge then checks that the request's tail came back."""
        committed = self.witness.computed.get(uid)
        if not self.caps.max_ahead or not self.check or committed is None:
            call_subject(what, getattr(self.subject, what), uid)
            return
        from kvledger.properties.subject_speculation import released  # only a subject holding slots ahead

        before = self.view()
        call_subject(what, getattr(self.subject, what), uid)
        released(self, uid, what, before, committed)

    def _forget(self, uid: int) -> None:
        for queue in (self.waiting, self.running):
            if uid in queue:
                queue.remove(uid)
        self.live.discard(uid)
        self.witness.computed.pop(uid, None)
        self.preempted.discard(uid)
        self.fit_alone.discard(uid)


def _check_victim(name: str, uid: int, victim: Any, live: Set[int]) -> None:
    if isinstance(victim, bool) or not isinstance(victim, int) or victim not in live:
        raise Finding(
            "6-preemption-order",
            f"an allocation for uid {uid} found no room and {name} named uid {victim!r} "
            f"to preempt, which is not a live request (live: {sorted(live)})",
        )


def _resume_place(
    waiting: List[int], live: Set[int], admitted: Dict[int, int], arrival: Dict[int, int], uid: int
) -> int:
    """Where a victim waits again: at the head, behind requests mid-prefill (running in vLLM's
    terms, scheduled first there; kvledger's own scheduler keeps them ahead too) and behind the
    requests waiting again that came before it. Under first come first served that is the order
    of their first admission: vLLM pops the newest running request and prepends it
    (`Scheduler._preempt_request`), so the one admitted first resumes first, and a subject that
    chooses its victims is held to the same order."""
    head = 0
    while head < len(waiting) and (
        waiting[head] in live or waiting[head] in admitted and arrival[waiting[head]] < arrival[uid]
    ):
        head += 1
    return head


def check_submit(
    uid: int, tokens: Sequence[int], max_tokens: int, known: Set[int], config: SubjectConfig, pages: int
) -> None:
    """InvalidOp for a submission no driver takes: a uid seen before, an empty prompt, more
    positions than max_seq_len, or `pages` (what the request needs at its peak) past the pool."""
    if uid in known:
        raise InvalidOp(f"submit: uid {uid} was already submitted")
    if not tokens or max_tokens < 1:
        raise InvalidOp(f"submit: uid {uid} needs a prompt and max_tokens >= 1")
    if len(tokens) + max_tokens > config.max_seq_len:
        raise InvalidOp(
            f"submit: uid {uid} needs {len(tokens) + max_tokens} positions, max_seq_len is {config.max_seq_len}"
        )
    if pages > config.num_pages:
        raise InvalidOp(f"submit: uid {uid} can never fit the pool of {config.num_pages} pages")


def _state(view: View) -> Tuple[Any, ...]:
    """What a refused admission must leave as it was. Cached entries are compared per location:
    a radix match may split a node, which moves no page and no lock."""
    cached = sorted(
        (int(loc), e.lock, None if e.key is None else str(e.key)) for e in view.cached for loc in e.locations
    )
    return (
        sorted(map(int, view.free)),
        {u: list(map(int, r)) for u, r in view.requests.items()},
        cached,
        sorted((view.page_refs or {}).items()),
        sorted(view.counters.items()),
        {u: list(map(int, r)) for u, r in view.preempted.items()},
    )


def drive(subject: Subject, config: SubjectConfig, ops: Sequence[TraceLine]) -> tuple[Finding | None, SubjectDriver]:
    """Apply `ops` to `subject` (an InvalidOp propagates); the first finding or None, and the driver."""
    driver = SubjectDriver(subject, config)
    for op in ops:
        try:
            driver.apply(op)
        except Finding as f:
            return f, driver
    return None, driver
