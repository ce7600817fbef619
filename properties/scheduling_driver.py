"""Judge mode for a subject that schedules itself (`properties/scheduling_subject.py`).

The driver submits requests and asks the subject for steps; the subject's own scheduler decides
what runs. The driver plays everything around it: the model (it writes KV for what a step
scheduled and samples tokens from the operation's `sample`), the drafter (it proposes
`spec_tokens` drafts per running request and accepts as many as the operation's `accept` says),
and the outside KV store (`ReplayStore`). A prefill(budget) and a decode are each one step of
the subject's scheduler: the prefill's budget caps the step's tokens, a decode runs with the
subject's own budget. Each step:

  1. `schedule(budget)`; the Plan is checked against what the driver knows (`12-step-plan`):
     every scheduled request is live or admitted in this step, starts where its KV ends, stays
     within its known tokens and the budget, verifies exactly the drafts proposed to it; every
     victim is live (and, unless the subject chooses its victims, the newest admitted one:
     `6-preemption-order`);
  2. the model runs: the KV of each scheduled range (drafts included) is written in the Witness,
     tokens are sampled, drafts accepted or rejected; the View is judged;
  3. once `in_flight` steps are scheduled, the oldest one's outputs are handed to the subject
     (`output`), outside loads that finished with them; the View is judged again, and the
     subject's waiting queue is judged for order (10-queue-order).

The model runs when a step is scheduled, so the Witness always holds the truth; the subject
learns it when the outputs arrive (a step later under async scheduling). A request ends when
its last token is delivered: until then it is live to the judge.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, Dict, List, NoReturn, Sequence, Set, Tuple, cast

from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.invariants import InvariantViolation, check_queue_order
from kvledger.engine.ledger.ops import InvalidOp, OpRecord, OpResult, TraceLine, as_record, dispatch
from kvledger.engine.ledger.trace import Header
from kvledger.properties import write_ahead
from kvledger.properties.group_writes import check_window_reads
from kvledger.properties.scheduling_subject import Output, Plan, Scheduled, SchedulingSubject, Step
from kvledger.properties.subject import SubjectConfig, View, header_of
from kvledger.properties.subject_calls import call_subject, raised
from kvledger.properties.subject_driver import check_submit
from kvledger.properties.subject_events import (
    EXHAUSTED_AT_DECODE,
    ahead_of_tokens,
    hit_events,
    pool_exhausted,
    window_events,
)
from kvledger.properties.subject_judge import Witness, judge
from kvledger.reference.pages import div_ceil

__all__ = ["ReplayStore", "SchedulingDriver"]


class ReplayStore:
    """The outside KV store the driver plays (a connector's storage, a host tier): it holds the
    KV of every whole-page prefix a request of this run computed, written there when computed
    (as an offloading connector saves each finished page). A request finds the longest stored
    prefix past its local hit, leaving its last token to compute; every other load it finds is
    asynchronous (the first synchronous), so both paths run."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.stored: Set[Tuple[int, ...]] = set()
        self.asked = 0

    def save(self, tokens: Sequence[int], computed: int) -> None:
        ps = self.page_size
        for end in range(ps, computed + 1, ps):
            self.stored.add(tuple(tokens[:end]))

    def match(self, tokens: Sequence[int], local_hit: int) -> Tuple[int, bool]:
        ps = self.page_size
        best = 0
        for end in range(ps, len(tokens), ps):  # a prefix that leaves the last token to compute
            if tuple(tokens[:end]) in self.stored:
                best = end
        found = max(0, best - local_hit)
        if not found:
            return 0, False
        self.asked += 1
        return found, self.asked % 2 == 0


class SchedulingDriver:
    def __init__(
        self,
        subject: SchedulingSubject,
        config: SubjectConfig,
        *,
        check: bool = True,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.subject = subject
        self.config = config
        self.caps = subject.capabilities
        self.check = check
        self.on_event = on_event or (lambda name: None)
        self.witness = Witness()
        self.max_tokens: Dict[int, int] = {}
        self.known: Set[int] = set()
        self.ended: Set[int] = set()
        self.arrival: Dict[int, int] = {}
        self.admitted: Dict[int, int] = {}  # uid -> the order number of its latest admission
        self.admissions = 0
        self.live: Set[int] = set()  # holding KV in the subject (admitted, not yet ended there)
        self.preempted: Set[int] = set()  # preempted and not admitted again
        self.ending: Set[int] = set()  # ended by the model; the subject learns it with the outputs
        self.loading: Dict[int, Tuple[int, int]] = {}  # uid -> (local hit, outside tokens) while its KV loads
        self.loaded: Set[int] = set()  # its outside KV arrived; it joins the running requests when next scheduled
        self.drafts: Dict[int, Tuple[int, ...]] = {}  # proposed for the request's next step
        self.in_flight: Deque[Step] = deque()
        self.store = ReplayStore(self.caps.page_size)
        if self.caps.external_kv:
            cast(Any, subject).store = self.store  # the connector asks it (scheduling_subject.ExternalStore)
        self.ops = 0
        self.history: List[OpRecord] = []  # the operations applied (the write-ahead record's prior)
        self._groups: int | None = None  # KV groups past the first (View.groups), read once

    def _pages_needed(self, positions: int) -> int:
        """The pages one request of `positions` positions holds at its peak, alone: a page per
        page_size positions in every KV group, a sliding window's too. A window group frees what
        left the window only once a step has computed it, and one step may compute a whole prompt
        (a preempted request starts again at position 0), so its peak is every page of the
        request, as vLLM's startup check sizes it (SlidingWindowSpec.max_admission_blocks_per_request
        with max_in_flight_tokens >= max_model_len: kv_cache_interface.py:918). Counting only the
        window's pages let the driver submit requests that an idle pool could never take again
        after a preemption: the pool would fail vLLM's check_enough_kv_cache_memory."""
        if self._groups is None:
            self._groups = len(self.view().groups)
        return div_ceil(positions, self.caps.page_size) * (1 + self._groups)

    @property
    def speculates(self) -> bool:
        return self.caps.spec_tokens > 0

    # The queues the workloads read. `running`: requests decoding, in admission order (one whose
    # last token is still on its way to the subject too: a step then flushes it); `waiting`: every
    # other request not ended, those holding KV (mid-prefill, loading) first, then preempted ones,
    # then the rest by arrival.
    @property
    def running(self) -> List[int]:
        done = [u for u in self.live - self.loading.keys() if self.witness.computed[u] >= self._prompt_end(u)]
        return sorted(done, key=lambda u: self.admitted[u])

    @property
    def waiting(self) -> List[int]:
        running = set(self.running)
        active = sorted((u for u in self.live if u not in running), key=lambda u: self.admitted[u])
        queued = sorted(
            self.known - self.ended - self.live,
            key=lambda u: (u not in self.preempted, self.admitted.get(u, 0), self.arrival[u]),
        )
        return active + queued

    def _prompt_end(self, uid: int) -> int:
        # a request decodes once its known tokens but the last have KV
        return len(self.witness.tokens[uid]) - 1

    def view(self) -> View:
        view: View = call_subject("view", self.subject.view)
        return view

    # -- operations ------------------------------------------------------------------------------
    def apply(self, line: TraceLine) -> OpResult:
        record = as_record(line)
        result = write_ahead.recorded(self, self._pool_header, self.history, record, lambda: dispatch(record.op, self))
        self.ops += 1
        return result

    def _pool_header(self) -> Header:
        return header_of(self.config, None, "kvledger", getattr(self.subject, "name", "subject"), "")

    def submit(self, uid: int, tokens: Sequence[int], max_tokens: int) -> OpResult:
        pages = self._pages_needed(len(tokens) + max_tokens - 1) if tokens else 0
        check_submit(uid, tokens, max_tokens, self.known, self.config, pages)
        call_subject("submit", self.subject.submit, uid, list(tokens), max_tokens)
        self.known.add(uid)
        self.arrival[uid] = len(self.arrival)
        self.witness.tokens[uid] = list(tokens)
        self.witness.prompt_len[uid] = len(tokens)
        self.max_tokens[uid] = max_tokens
        self._judge()
        return OpResult()

    def prefill(
        self, budget: int, sample: Sequence[int] = (), stop: Sequence[int] = (), accept: Sequence[int] = ()
    ) -> OpResult:
        if budget < 1:
            raise InvalidOp(f"prefill: budget must be >= 1, got {budget}")
        return self._step(budget, sample, stop, accept)

    def decode(self, sample: Sequence[int] = (), stop: Sequence[int] = (), accept: Sequence[int] = ()) -> OpResult:
        return self._step(None, sample, stop, accept)

    def finish(self, uid: int) -> OpResult:
        if uid not in self.running:
            raise InvalidOp(f"finish: uid {uid} is not running")
        call_subject("finish", self.subject.finish, uid)
        self._forget(uid)
        self._judge()
        return OpResult()

    def abort(self, uid: int) -> OpResult:
        if uid not in self.known or uid in self.ended or uid in self.ending:
            raise InvalidOp(f"abort: uid {uid} is neither waiting nor running")
        if uid in self.loading:
            self.on_event("external: aborted while its KV loads")
        elif uid in self.live and uid not in self.running:
            self.on_event("abort: mid-prefill")
        call_subject("abort", self.subject.abort, uid)
        self._forget(uid)
        self._judge()
        return OpResult()

    def evict(self, tokens: int) -> OpResult:
        raise InvalidOp(f"evict: {self.subject.name} evicts by its own policy only")

    def probe(self, tokens: Sequence[int]) -> OpResult:
        raise InvalidOp("probe: not an operation a subject is driven with")

    # -- a step ------------------------------------------------------------------------------------
    def _step(self, budget: int | None, sample: Sequence[int], stop: Sequence[int], accept: Sequence[int]) -> OpResult:
        if len(set(stop)) < len(stop) or set(stop) - (self.known - self.ended - self.ending):
            raise InvalidOp(f"step: stop {list(stop)} must name requests not ended, each once")
        if accept and not self.speculates:
            raise InvalidOp(f"step: accept is for a subject that speculates, not {self.subject.name}")
        before = self.view() if self.check else None
        if before is not None and pool_exhausted(before, self.caps.page_size) and self._decode_needs_page():
            self.on_event(EXHAUSTED_AT_DECODE)
        plan: Plan = call_subject("schedule", self.subject.schedule, budget)
        self._check_plan(plan, budget, before)
        if self.in_flight and plan.scheduled:
            self.on_event("async: a step scheduled before the previous one's outputs")
        step = Step(plan)
        self._run(step, sample, stop, accept)
        self.in_flight.append(step)
        self._judge()
        while self.in_flight and (len(self.in_flight) >= self.caps.in_flight or not plan.scheduled):
            self._deliver(self.in_flight.popleft())
            self._judge()
        ran = tuple(s.uid for s in plan.scheduled if s.end > s.start)
        return OpResult(batch=ran, refused=plan.refused, preempted=plan.preempted)

    def _decode_needs_page(self) -> bool:
        ps = self.caps.page_size
        return any(self.witness.computed[u] % ps == 0 for u in self.running)

    def _check_plan(self, plan: Plan, budget: int | None, before: View | None) -> None:
        for uid in plan.preempted:
            self._take_victim(uid)
        spent = 0
        seen: Set[int] = set()
        for item in plan.scheduled:
            if item.uid in seen:
                _bad(f"uid {item.uid} is scheduled twice in one step")
            seen.add(item.uid)
            if item.hit is not None:
                self._take_admission(item, item.uid in plan.loading, before)
            elif item.uid not in self.live or item.uid in self.loading:
                _bad(f"uid {item.uid} is scheduled, but it is not running (nor admitted in this step)")
            elif item.uid in self.loaded:  # vLLM appends it to `running` now: it is the newest there
                self.loaded.discard(item.uid)
                self.admitted[item.uid] = self.admissions
                self.admissions += 1
            computed = self.witness.computed[item.uid]
            tokens = self.witness.tokens[item.uid]
            if item.start != computed or item.end < item.start or item.end > len(tokens):
                _bad(
                    f"uid {item.uid} is scheduled for positions [{item.start}, {item.end}), but its KV "
                    f"ends at {computed} and it has {len(tokens)} tokens"
                )
            proposed = self.drafts.pop(item.uid, ())
            real = tuple(d for d in item.drafts if d >= 0)  # negative: padding (vLLM pads a new decode)
            if item.drafts and item.end != len(tokens):
                _bad(
                    f"uid {item.uid} verifies drafts {list(item.drafts)} after position {item.end}, but its "
                    f"last token is at {len(tokens) - 1}: drafts follow a request's last token only"
                )
            if real != proposed[: len(real)]:
                _bad(f"uid {item.uid} verifies drafts {list(item.drafts)}, but was proposed {list(proposed)}")
            spent += item.end - item.start + len(item.drafts)
        if plan.refused is not None:
            # a request holding KV it loaded from outside may be refused the rest of its prompt
            if plan.refused not in self.known or plan.refused in self.ended or plan.refused in self.running:
                _bad(f"uid {plan.refused} is refused admission, but it is not waiting")
            self.on_event("admission: refused")
        if budget is not None and spent > budget:
            _bad(f"the step scheduled {spent} tokens, its budget was {budget}")

    def _take_victim(self, uid: int) -> None:
        if uid not in self.live:
            _bad(f"uid {uid} is preempted, but it is not running", "6-preemption-order")
        if not self.caps.chooses_victim:
            # a request loading outside KV (or loaded, not yet scheduled) is not running yet: never a victim
            newest = max(self.live - self.loading.keys() - self.loaded, key=lambda u: self.admitted[u])
            if uid != newest:
                _bad(f"uid {uid} is preempted, but the newest admitted request is uid {newest}", "6-preemption-order")
        self.on_event("preempt: a running request preempted")
        if self.preempted:
            self.on_event("preempt: two victims waiting to resume")
        self.live.discard(uid)
        self.loading.pop(uid, None)
        self.witness.computed.pop(uid, None)
        self.drafts.pop(uid, None)
        self.preempted.add(uid)

    def _take_admission(self, item: Scheduled, loads: bool, before: View | None) -> None:
        uid, hit = item.uid, item.hit
        tokens = self.witness.tokens.get(uid)
        if uid not in self.known or uid in self.live or uid in self.ended or tokens is None:
            _bad(f"uid {uid} is admitted, but it is not waiting")
        if not isinstance(hit, int) or not 0 <= hit < len(tokens) or not 0 <= item.external <= hit:
            raise Finding(
                "8-request",
                f"uid {uid} was admitted with a hit of {hit!r} tokens ({item.external} from outside), but it "
                f"has {len(tokens)}: a hit must leave the last token to compute",
            )
        if item.external and not self.caps.external_kv:
            _bad(f"uid {uid} loads {item.external} tokens from outside, but the subject declares no external_kv")
        self.live.add(uid)
        self.preempted.discard(uid)
        self.admitted[uid] = self.admissions
        self.admissions += 1
        local = hit - item.external
        self.witness.computed[uid] = local
        if item.external:
            self.on_event("external: KV loaded from outside")
            if loads:
                self.loading[uid] = (local, item.external)
                return
            self._loaded(uid, local, item.external, None)
        if hit and before is not None:
            mid_prefill = {u for u in self.live if u != uid and u not in self.running}
            after = self.view()
            for event in hit_events(uid, hit, before, after, self.witness, mid_prefill, self.caps.page_size):
                self.on_event(event)
            for event in window_events(uid, hit, after):
                self.on_event(event)

    def _loaded(self, uid: int, local: int, external: int, view: View | None) -> None:
        """The outside KV of positions [local, local + external) arrived: it counts as written."""
        view = view or self.view()
        self._write(view, uid, self.witness.tokens[uid], local, local + external)
        self.witness.computed[uid] = local + external

    # -- the model ---------------------------------------------------------------------------------
    def _run(self, step: Step, sample: Sequence[int], stop: Sequence[int], accept: Sequence[int]) -> None:
        view = self.view() if step.plan.scheduled else None
        sampled_n = 0
        verified_n = 0
        for item in step.plan.scheduled:
            uid = item.uid
            if uid in self.loading or item.end == item.start:
                continue
            assert view is not None
            tokens = self.witness.tokens[uid]
            check_window_reads(view, self.witness, uid, tokens, item.start)
            written = tokens[: item.end] + list(item.drafts)
            self._write(view, uid, written, item.start, item.end + len(item.drafts))
            self.witness.computed[uid] = item.end
            if uid in self.ending:  # scheduled before its end reached the subject: output discarded
                step.outputs[uid] = Output(tokens=(self._token(sample, sampled_n),))
                sampled_n += 1
                continue
            if item.end < len(tokens):
                self.on_event("prefill: chunked")
                step.outputs[uid] = Output()
                self.store.save(tokens, item.end)
                continue
            m = 0
            if item.drafts:
                # a padding draft (negative) is never sampled, so nothing past it is accepted
                real = next((i for i, d in enumerate(item.drafts) if d < 0), len(item.drafts))
                m = min(int(accept[verified_n % len(accept)]) if accept else 0, real)
                verified_n += 1
                self.on_event("spec: every draft accepted" if m == len(item.drafts) else "spec: a draft rejected")
            bonus = self._token(sample, sampled_n)
            sampled_n += 1
            if m < len(item.drafts) and bonus == item.drafts[m]:
                bonus += 1  # the model disagrees with the rejected draft
            out = list(item.drafts[:m]) + [bonus]
            room = self.max_tokens[uid] - (len(tokens) - self.witness.prompt_len[uid])
            out = out[:room]
            tokens.extend(out)
            self.witness.computed[uid] = item.end + len(out) - 1
            self.store.save(tokens, self.witness.computed[uid])
            ends = uid in stop or len(out) == room
            if ends:
                self.ending.add(uid)
                step.ending.append(uid)
            elif self.caps.spec_tokens:
                self.drafts[uid] = tuple(self._token(sample, sampled_n + i) for i in range(self.caps.spec_tokens))
            step.outputs[uid] = Output(tokens=tuple(out), stop=uid in stop, drafts=self.drafts.get(uid, ()))
        # an outside load completes with the next step's outputs, not with those of the step that
        # began it, so an operation (an abort) can come while it loads
        step.loaded.extend(sorted(u for u in self.loading if u not in step.plan.loading))

    @staticmethod
    def _token(sample: Sequence[int], n: int) -> int:
        return int(sample[n % len(sample)]) if sample else 0

    def _write(self, view: View, uid: int, tokens: Sequence[int], start: int, end: int) -> None:
        """A forward pass wrote KV for positions [start, end) of `tokens`, in every KV group."""
        self.witness.wrote_view(view, uid, tokens, start, end)

    def _deliver(self, step: Step) -> None:
        """The subject gets the oldest step's outputs (and the outside loads that finished)."""
        loaded = [u for u in step.loaded if u in self.loading]
        if loaded:
            view = self.view()
            for uid in loaded:
                local, external = self.loading.pop(uid)
                self._loaded(uid, local, external, view)
                self.loaded.add(uid)
                self.on_event("external: an asynchronous load completed")
        call_subject("output", self.subject.output, step.outputs, loaded)
        for uid in step.ending:
            if uid in self.ending:  # not finished or aborted meanwhile
                self._forget(uid)

    def _forget(self, uid: int) -> None:
        self.live.discard(uid)
        self.ended.add(uid)
        self.ending.discard(uid)
        self.preempted.discard(uid)
        self.loading.pop(uid, None)
        self.loaded.discard(uid)
        self.drafts.pop(uid, None)
        self.witness.computed.pop(uid, None)

    # -- the judge ---------------------------------------------------------------------------------
    def _judge(self) -> None:
        if not self.check:
            return
        view = self.view()
        self.witness.preempted = set(self.preempted)
        try:
            judge(view, self.caps, self.witness, self.subject)
            if view.waiting is not None:
                order = self.caps.resume_order
                check_queue_order(view.waiting, self.arrival, self.admitted, self.preempted, self.live, order)
        except InvariantViolation as e:
            raise Finding(e.invariant, str(e).split("] ", 1)[-1]) from e
        except Finding:
            raise
        except Exception as e:  # cache_key is the subject's own code
            raise raised(e, "while judging") from e
        if view.groups:
            for event in window_events(-1, 0, view):
                self.on_event(event)
        if self.caps.max_ahead and ahead_of_tokens(view, self.witness, self.caps.page_size):
            self.on_event("ahead: a request holds slots past its tokens")
        if not self.live and self.known == self.ended and self.ops:
            self.on_event("driver: idle after work")


def _bad(message: str, invariant: str = "12-step-plan") -> NoReturn:
    raise Finding(invariant, message)
