"""The engine thread: the only thread that touches the Scheduler.

The HTTP side hands it commands through a thread-safe queue (`submit`, `abort`) and gets results
through a per-request `Sink` callable, which the engine thread calls and which must not block
(the app's sink hands the item to the event loop with `call_soon_threadsafe`). Between steps the
thread applies every queued command, so an abort frees its request's slot and pages before the
next forward. Whenever the engine goes idle it proves the page partition (no page leaked, no lock
held) and publishes the result.

Failures: a request the engine cannot finish (its sampling failed, or an injected fault that the
engine contained ended it: engine/runtime/step_faults.py) fails alone, as a `Failed` to its sink.
Any other exception inside a step is an engine fault: the scheduler's state can no longer be
trusted, so every open request fails, the fault is logged with its traceback, `alive` turns false
and `on_fault` is called (the server then exits non-zero for a supervisor to restart it; with
`exit_deadline` the process is ended that many seconds later if it has not exited by itself).

Watchdog: with the engine option `step_timeout` > 0, a step that has not returned after that many
seconds is a stall, the same kind of fault: `alive` turns false at once, the step's batch and the
ledger's state are logged, every open request fails, `on_fault` is called. The engine thread cannot
be interrupted; whatever it does after it returns is dropped. Faults are counted by kind
(`EngineStats.faults`: faults_forward_raise, faults_alloc_refuse, faults_step_stall,
faults_cuda_poison, faults_stall (the watchdog's), faults_internal (any other exception)).

Shutdown: `drain(seconds)` refuses new requests and lets open ones run for at most that long; the
rest then fail with status 503 ("shutting down"), and `drained` is set.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

from kvledger.engine.ledger.cache_scheduler import InvalidOp
from kvledger.engine.runtime.faults import InjectedFault
from kvledger.engine.runtime.request_error import RequestError
from kvledger.engine.server.request_timing import RequestTiming
from kvledger.fast import SamplingParams

log = logging.getLogger("kvledger.serve")
RATE_WINDOW_S = 10.0
ENGINE_DOWN = "the engine stopped after an internal error; the server is restarting"


# -- what the engine thread sends back ---------------------------------------------------------
@dataclass
class Accepted:
    uid: int


@dataclass
class Token:
    token: int
    finished: bool
    finish_reason: Optional[str]  # "stop" or "length" once finished
    cached_tokens: int  # prompt tokens found in the prefix cache


@dataclass
class Failed:
    message: str
    status: int = 400  # 400: the request can never run; 503: overloaded, down or shutting down; 500: a fault
    param: Optional[str] = None
    code: Optional[str] = None


Event = Union[Accepted, Token, Failed]
Sink = Callable[[Event], None]


# -- what the HTTP side sends it ---------------------------------------------------------------
@dataclass
class Submit:
    uid: int
    token_ids: List[int]
    params: SamplingParams
    sink: Sink
    arrival: float = field(default_factory=time.monotonic)  # for the metrics (request_timing.py) only


@dataclass
class Abort:
    uid: int
    reason: str = "abort"  # the finish reason /metrics counts: "stop" when a stop string ended it


@dataclass
class Drain:
    seconds: float


@dataclass
class Wake:
    pass


Command = Union[Submit, Abort, Drain, Wake]


@dataclass
class OpenRequest:
    """The worker's side of an accepted request, until it ends."""

    sink: Sink
    prompt_len: int


# -- what it publishes -------------------------------------------------------------------------
@dataclass(frozen=True)
class IntegrityReport:
    ok: bool
    checked_at: float  # time.time(); 0 before the first check
    checks: int
    total_pages: int
    free_pages: int
    cached_pages: int
    leaked_pages: int  # pages neither free nor cached with nothing live
    locked_tokens: int  # cached tokens still locked with nothing live
    error: Optional[str] = None


@dataclass(frozen=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    total_pages: int = 0
    free_pages: int = 0
    cached_pages: int = 0
    owned_pages: int = 0  # pages held by live requests beyond the prefix cache
    locked_tokens: int = 0
    prompt_tokens: int = 0  # of admitted requests that have ended
    prefix_hit_tokens: int = 0
    generated_tokens: int = 0
    tokens_per_s: float = 0.0
    cache_ops: int = 0  # operations applied to the cache manager (submit, prefill, decode, abort)
    finished: int = 0
    aborted: int = 0
    rejected: int = 0
    failed: int = 0
    verified_ops: Optional[int] = None  # operations mirrored in the reference model (--verify)
    preemptions: int = 0  # requests preempted to make room (optimistic admission only)
    recomputed_tokens: int = 0  # KV positions computed again after a preemption
    faults: Dict[str, int] = field(default_factory=dict)  # faults_<kind> -> how many struck (the module doc)


class EngineWorker:
    def __init__(
        self,
        llm,
        *,
        max_waiting: int = 1024,
        on_fault: Optional[Callable[[str], None]] = None,
        exit_deadline: Optional[float] = None,
    ) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.limits = self.engine.limits
        self.max_waiting = max_waiting
        self._inbox: "queue.SimpleQueue[Command]" = queue.SimpleQueue()
        # the LLM may have run requests before (a warm-up): uids must stay new to the engine
        self._uids = itertools.count(self.engine.next_uid())
        self._open: Dict[int, OpenRequest] = {}  # accepted and not yet ended
        self._counts = {
            "finished": 0,
            "aborted": 0,
            "rejected": 0,
            "failed": 0,
            "prompt_tokens": 0,
            "prefix_hit_tokens": 0,
            "generated_tokens": 0,
        }
        self._faults: Dict[str, int] = {}  # faults_<kind> -> count
        self._rate: Deque[Tuple[float, int]] = deque()
        self._dirty = False  # something ran since the last idle check
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvledger-engine", daemon=True)
        # the engine thread and the watchdog both end requests: whoever touches _open holds this
        self._lock = threading.RLock()
        self.fatal: Optional[str] = None
        self.on_fault = on_fault
        self.exit_deadline = exit_deadline
        timeout = getattr(llm.engine_config, "step_timeout", None)
        self.step_timeout: Optional[float] = float(timeout) if timeout else None
        self._step_began: Optional[float] = None  # time.monotonic() when the step in progress began
        self._watchdog = threading.Thread(target=self._watch, name="kvledger-watchdog", daemon=True)
        self._drain_until: Optional[float] = None  # time.monotonic() after which open requests are failed
        self.draining = False  # set at once by drain(), for /health
        self.drained = threading.Event()
        self.stats = EngineStats()
        pages = self.engine.config.num_pages
        self.integrity = IntegrityReport(True, 0.0, 0, pages, pages, 0, 0, 0)
        self.timing = RequestTiming(self.limits.max_seq_len)  # the latency histograms of /metrics
        self._publish()

    # -- the HTTP side's API (any thread) ------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        if self.step_timeout is not None:
            self._watchdog.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(Wake())
        # a stalled engine thread never returns: do not wait for it
        self._thread.join(timeout if self.fatal is None else min(timeout, 0.5))

    def drain(self, seconds: float) -> None:
        """Refuse new requests; give open ones `seconds` to finish, then fail them. Sets `drained`."""
        self.draining = True
        self._inbox.put(Drain(seconds))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None and not self.stalled

    @property
    def stalled(self) -> bool:
        """Whether the step in progress has run past the step timeout (before the watchdog's next look)."""
        began, limit = self._step_began, self.step_timeout
        return began is not None and limit is not None and time.monotonic() - began > limit

    def submit(self, token_ids: Sequence[int], params: SamplingParams, sink: Sink) -> int:
        """Queue a request; `sink` gets Accepted or Failed, then its tokens. Returns its uid."""
        with self._lock:
            uid = next(self._uids)
            if self.fatal is not None:  # the engine thread may be stuck: nobody would answer it
                self._reject(sink, Failed(ENGINE_DOWN, 503))
            else:
                self._inbox.put(Submit(uid, list(token_ids), params, sink))
        return uid

    def abort(self, uid: int, reason: str = "abort") -> None:
        """Drop the request (waiting or running) if it is still open; a no-op once it ended."""
        self._inbox.put(Abort(uid, reason))

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._iterate()
            except Exception as e:  # a fault in the engine: fail every open request rather than hang it
                self._step_began = None
                self._fault(e)
            self._publish()
            if self._drain_until is not None and not self.drained.is_set():
                self._check_drained()
        self._fail_all("the server is shutting down", 503, "shutting_down")

    def _iterate(self) -> None:
        busy = self.fatal is None and self.engine.has_work
        self._drain(block=not busy)
        if self.fatal is None and self.engine.has_work:
            self._step()
        if self._dirty and self.fatal is None and not self.engine.has_work and not self._open:
            self._check_idle()

    def _drain(self, block: bool) -> None:
        try:
            # the timeout only bounds how stale the published figures (tokens/s) get while idle
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            with self._lock:
                self._apply(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: Command) -> None:
        if isinstance(cmd, Submit):
            self._submit(cmd.uid, cmd.token_ids, cmd.params, cmd.sink)
            if cmd.uid in self._open:
                self.timing.submitted(cmd.uid, len(cmd.token_ids), cmd.arrival)
        elif isinstance(cmd, Abort):
            if cmd.uid in self._open and self.fatal is None:
                self.timing.ended(cmd.uid, cmd.reason)
            self._abort(cmd.uid)
        elif isinstance(cmd, Drain):  # a second drain can only shorten the window
            until = time.monotonic() + cmd.seconds
            self._drain_until = until if self._drain_until is None else min(self._drain_until, until)

    def _check_drained(self) -> None:
        with self._lock:
            self._check_drained_locked()

    def _check_drained_locked(self) -> None:
        # the drain window is the one place wall-clock time decides: it only chooses when the
        # remaining requests are aborted at shutdown, never what a running request computes
        if self._open and self._drain_until is not None and time.monotonic() < self._drain_until:
            return
        if self._open:
            log.warning("drain window over: aborting %d open request(s)", len(self._open))
            for uid, sink in [(uid, o.sink) for uid, o in self._open.items()]:
                self._abort(uid, counter="failed")
                _send(
                    sink,
                    Failed(
                        "the server is shutting down; the request was stopped before it finished",
                        503,
                        code="shutting_down",
                    ),
                )
        self.drained.set()

    def _submit(self, uid: int, ids: List[int], params: SamplingParams, sink: Sink) -> None:
        if self.fatal is not None:
            return self._reject(sink, Failed(ENGINE_DOWN, 503))
        if self._drain_until is not None:
            return self._reject(sink, Failed("the server is shutting down", 503, code="shutting_down"))
        if self.engine.waiting_requests >= self.max_waiting:
            return self._reject(
                sink, Failed(f"the server is overloaded ({self.max_waiting} requests waiting); retry later", 503)
            )
        try:
            self.engine.add_request(ids, params, uid)
        except RequestError as e:  # the request can never run: e.param names the field
            return self._reject(sink, Failed(str(e), 400, e.param))
        except InvalidOp as e:  # e.g. a uid the scheduler has seen: this request only
            return self._reject(sink, Failed(str(e), 400))
        except Exception as e:
            self._reject(sink, Failed(f"engine fault while submitting the request: {type(e).__name__}: {e}", 500))
            raise
        self._open[uid] = OpenRequest(sink, len(ids))
        self._dirty = True
        _send(sink, Accepted(uid))

    def _reject(self, sink: Sink, failure: Failed) -> None:
        self._counts["rejected"] += 1
        _send(sink, failure)

    def _abort(self, uid: int, counter: str = "aborted") -> None:
        if uid not in self._open or self.fatal is not None:
            return  # already ended: finished, failed, or never accepted
        rec = self.engine.requests.get(uid)
        self.engine.abort(uid)  # raises only if engine and worker disagree: a fault
        prompt_len = self._open.pop(uid).prompt_len
        self._counts[counter] += 1
        self.timing.ended(uid, "abort" if counter == "aborted" else "error")
        self._ended(prompt_len, None if rec is None else rec.cached_tokens)

    def _step(self) -> None:
        started = self._step_began = time.monotonic()
        events = self.engine.step()
        self._step_began = None
        with self._lock:
            if self.fatal is None:  # else the watchdog declared the engine stalled meanwhile: dropped
                self.timing.stepped(events, started, self.engine.requests)
                self._deliver(events)

    def _deliver(self, events) -> None:
        for ev in events:
            open_ = self._open.get(ev.uid)
            sink = open_.sink if open_ is not None else None
            if ev.finished:
                self._open.pop(ev.uid, None)
                self._counts["failed" if ev.error is not None else "finished"] += 1
            if sink is not None:
                if ev.error is not None:  # this request alone failed; the engine goes on
                    log.error("request %d failed: %s", ev.uid, ev.error)
                    _send(sink, Failed(ev.error, 500))
                else:
                    _send(sink, Token(ev.token, ev.finished, ev.finish_reason, ev.cached_tokens))
            if ev.finished and open_ is not None:
                self._ended(open_.prompt_len, ev.cached_tokens)
        self._counts["generated_tokens"] += sum(ev.error is None for ev in events)
        self._rate.append((time.monotonic(), len(events)))

    def _ended(self, prompt_len: int, hit: Optional[int]) -> None:
        """Count an ended request's prompt and prefix hit, if it was ever admitted (hit not None)."""
        if hit is not None:
            self._counts["prompt_tokens"] += prompt_len
            self._counts["prefix_hit_tokens"] += hit

    def _fault(self, exc: BaseException) -> None:
        # the scheduler's state can no longer be trusted, so the engine stops serving
        # an injected one is counted where it struck (the engine's StepFaults)
        kind = None if isinstance(exc, InjectedFault) else "internal"
        self._die(f"{type(exc).__name__}: {exc}", kind, exc)

    def _die(self, why: str, kind: Optional[str], exc: Optional[BaseException] = None) -> None:
        """An uncontained fault: out of service at once, every open request failed, `on_fault`."""
        with self._lock:
            first = self.fatal is None
            self.fatal = self.fatal or why
            if first and kind is not None:
                self._count_fault(kind)
            log.error("engine fault, failing %d open request(s) and stopping the engine", len(self._open), exc_info=exc)
            self._fail_all(f"engine fault: {self.fatal}", 500)
            self._refuse_queued()
        if not first:
            return
        if self.exit_deadline is not None:  # the supervisor's restart must not wait on a stuck shutdown
            timer = threading.Timer(self.exit_deadline, _exit_now, args=(self.fatal,))
            timer.daemon = True
            timer.start()
        if self.on_fault is not None:
            self.on_fault(self.fatal)

    def _refuse_queued(self) -> None:
        """Requests queued for an engine thread that may never read them again: refused now."""
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, Submit):
                self._reject(cmd.sink, Failed(ENGINE_DOWN, 503))

    def _count_fault(self, kind: str) -> None:
        name = "faults_" + kind.replace("-", "_")
        self._faults[name] = self._faults.get(name, 0) + 1

    def _watch(self) -> None:
        """The watchdog: declares the engine stalled once a step runs past `step_timeout`."""
        limit = self.step_timeout
        assert limit is not None
        poll = min(1.0, limit / 4)
        while not self._stop.wait(poll):
            if self.fatal is not None:
                return
            if self.stalled:
                limit_s = f"{limit:g}"
                log.critical(
                    "watchdog: a step has not returned after %s s; the engine is stalled. The step:\n%s",
                    limit_s,
                    self._describe(),
                )
                self._die(f"stall: a step did not return within the step timeout ({limit_s} s)", "stall")
                return

    def _describe(self) -> str:
        try:
            return self.engine.describe()
        except Exception as e:  # read from another thread while the engine is stuck: best effort
            return f"(the engine's state could not be read: {type(e).__name__}: {e})"

    def _fail_all(self, message: str, status: int, code: Optional[str] = None) -> None:
        with self._lock:
            for o in list(self._open.values()):
                self._counts["failed"] += 1
                _send(o.sink, Failed(message, status, code=code))
            self._open.clear()

    def _check_idle(self) -> None:
        self._dirty = False
        error = None
        try:
            self.engine.check_idle()
            if self.llm.shadow is not None:
                self.llm.shadow.model.check()  # the reference model's own view of the same invariants
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        pages = self.engine.page_stats()
        ok = error is None and pages.owned == 0 and pages.locked_tokens == 0
        self.integrity = IntegrityReport(
            ok,
            time.time(),
            self.integrity.checks + 1,
            pages.total,
            pages.free,
            pages.cached,
            pages.owned,
            pages.locked_tokens,
            error,
        )
        if not ok:
            log.error("idle integrity check failed: %s", self.integrity)

    def _publish(self) -> None:
        engine = self.engine
        pages = engine.page_stats()
        now = time.monotonic()
        while self._rate and self._rate[0][0] < now - RATE_WINDOW_S:
            self._rate.popleft()
        span = max(1.0, now - self._rate[0][0]) if self._rate else RATE_WINDOW_S
        c = self._counts
        with self._lock:  # the watchdog may be failing them meanwhile
            open_now = list(self._open)
        self.timing.sync(open_now)  # requests failed by a fault or a drain ended in error
        self.stats = EngineStats(
            running=engine.running_requests,
            waiting=engine.waiting_requests,
            total_pages=pages.total,
            free_pages=pages.free,
            cached_pages=pages.cached,
            owned_pages=pages.owned,
            locked_tokens=pages.locked_tokens,
            prompt_tokens=c["prompt_tokens"],
            prefix_hit_tokens=c["prefix_hit_tokens"],
            generated_tokens=c["generated_tokens"],
            tokens_per_s=sum(n for _, n in self._rate) / span,
            cache_ops=engine.operations,
            finished=c["finished"],
            aborted=c["aborted"],
            rejected=c["rejected"],
            failed=c["failed"],
            verified_ops=self.llm.shadow.steps if self.llm.shadow is not None else None,
            preemptions=engine.preemptions,
            recomputed_tokens=engine.recomputed_tokens,
            faults=self._fault_counts(),
        )

    def _fault_counts(self) -> Dict[str, int]:
        counts = dict(self._faults)
        steps = self.engine.faults
        struck = steps.struck if steps is not None else {}  # the injected ones that struck
        for kind, n in [*struck.items(), *self.engine.contained.items()]:  # and the real ones contained
            name = "faults_" + kind.replace("-", "_")
            counts[name] = counts.get(name, 0) + n
        return counts


def _exit_now(why: str) -> None:
    log.critical("the process did not exit after the engine fault (%s): exiting now with status 1", why)
    logging.shutdown()
    os._exit(1)


def _send(sink: Sink, event: Event) -> None:
    try:
        sink(event)
    except Exception:  # a closed event loop at shutdown; the engine thread must go on
        pass
