"""The engine thread: the only thread that touches the Scheduler.

The HTTP side hands it commands through a thread-safe queue (`submit`, `abort`) and gets results
through a per-request `Sink` callable, which the engine thread calls and which must not block
(the app's sink hands the item to the event loop with `call_soon_threadsafe`). Between steps the
thread applies every queued command, so an abort frees its request's slot and pages before the
next forward. Whenever the engine goes idle it proves the page partition (no page leaked, no lock
held) and publishes the result; an exception inside a step fails every open request and marks the
engine unhealthy rather than serving from a state that can no longer be trusted.
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

from fast import SamplingParams

RATE_WINDOW_S = 10.0


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
    status: int = 400  # 400: the request can never run; 503: overloaded or engine down; 500: engine fault
    param: Optional[str] = None


Event = Union[Accepted, Token, Failed]
Sink = Callable[[Event], None]


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


@dataclass(frozen=True)
class Limits:
    max_seq_len: int
    vocab_size: int
    page_size: int
    pool_tokens: int


class EngineWorker:
    def __init__(self, llm, *, max_waiting: int = 1024) -> None:
        self.llm = llm
        self.scheduler = llm.scheduler
        cfg = self.scheduler.config
        self.limits = Limits(cfg.max_seq_len, self.scheduler.vocab_size, cfg.page_size, cfg.num_pages * cfg.page_size)
        self.max_waiting = max_waiting
        self._inbox: "queue.SimpleQueue[Tuple]" = queue.SimpleQueue()
        # the LLM may have run requests before (a warm-up): uids must stay new to the scheduler
        last = self.scheduler.driver.last_uid
        self._uids = itertools.count(0 if last is None else last + 1)
        self._sinks: Dict[int, Sink] = {}
        self._prompt_len: Dict[int, int] = {}
        self._counts = {"finished": 0, "aborted": 0, "rejected": 0, "failed": 0, "prompt_tokens": 0,
                        "prefix_hit_tokens": 0, "generated_tokens": 0}
        self._rate: Deque[Tuple[float, int]] = deque()
        self._dirty = False  # something ran since the last idle check
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvledger-engine", daemon=True)
        self.fatal: Optional[str] = None
        self.stats = EngineStats()
        self.integrity = IntegrityReport(True, 0.0, 0, cfg.num_pages, cfg.num_pages, 0, 0, 0)
        self._publish()

    # -- the HTTP side's API (any thread) ------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    def submit(self, token_ids: Sequence[int], params: SamplingParams, sink: Sink) -> int:
        """Queue a request; `sink` gets Accepted or Failed, then its tokens. Returns its uid."""
        uid = next(self._uids)
        self._inbox.put(("submit", uid, list(token_ids), params, sink))
        return uid

    def abort(self, uid: int) -> None:
        """Drop the request (waiting or running) if it is still open; a no-op once it ended."""
        self._inbox.put(("abort", uid))

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._iterate()
            except Exception as e:  # a fault in the engine: fail every open request rather than hang it
                self._fault(e)
            self._publish()
        self._fail_all("the server is shutting down", 503)

    def _iterate(self) -> None:
        busy = self.fatal is None and self.scheduler.has_work
        self._drain(block=not busy)
        if self.fatal is None and self.scheduler.has_work:
            self._step()
        if self._dirty and self.fatal is None and not self.scheduler.has_work and not self._sinks:
            self._check_idle()

    def _drain(self, block: bool) -> None:
        try:
            # the timeout only bounds how stale the published figures (tokens/s) get while idle
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: Tuple) -> None:
        if cmd[0] == "submit":
            _, uid, ids, params, sink = cmd
            self._submit(uid, ids, params, sink)
        elif cmd[0] == "abort":
            self._abort(cmd[1])

    def _submit(self, uid: int, ids: List[int], params: SamplingParams, sink: Sink) -> None:
        if self.fatal is not None:
            return self._reject(sink, Failed(f"the engine stopped after an internal error: {self.fatal}", 503))
        if len(self.scheduler.driver.waiting) >= self.max_waiting:
            return self._reject(sink, Failed(f"the server is overloaded ({self.max_waiting} requests waiting); "
                                             "retry later", 503))
        try:
            self.scheduler.submit(uid, ids, params)
        except ValueError as e:  # names the field; the driver's InvalidOp is a ValueError too
            from engine.server.protocol import param_from_message

            return self._reject(sink, Failed(str(e), 400, param_from_message(str(e))))
        except Exception:
            self._reject(sink, Failed("internal engine error while submitting the request", 500))
            raise
        self._sinks[uid] = sink
        self._prompt_len[uid] = len(ids)
        self._dirty = True
        _send(sink, Accepted(uid))

    def _reject(self, sink: Sink, failure: Failed) -> None:
        self._counts["rejected"] += 1
        _send(sink, failure)

    def _abort(self, uid: int) -> None:
        if uid not in self._sinks or self.fatal is not None:
            return  # already ended: finished, failed, or never accepted
        self.scheduler.abort(uid)  # raises only if scheduler and worker disagree: a fault
        del self._sinks[uid]
        self._counts["aborted"] += 1
        self._ended(uid)

    def _step(self) -> None:
        events = self.scheduler.step()
        hits = self.scheduler.prefix_hit_tokens
        for ev in events:
            sink = self._sinks.get(ev.uid)
            if ev.finished:
                self._sinks.pop(ev.uid, None)
                self._counts["finished"] += 1
            if sink is not None:
                _send(sink, Token(ev.token, ev.finished, ev.finish_reason, hits.get(ev.uid, 0)))
            if ev.finished:
                self._ended(ev.uid)
        self._counts["generated_tokens"] += len(events)
        self._rate.append((time.monotonic(), len(events)))

    def _ended(self, uid: int) -> None:
        n = self._prompt_len.pop(uid, 0)
        # the scheduler keeps one entry per admitted request forever; a server must not
        hit = self.scheduler.prefix_hit_tokens.pop(uid, None)
        if hit is not None:
            self._counts["prompt_tokens"] += n
            self._counts["prefix_hit_tokens"] += hit

    def _fault(self, exc: BaseException) -> None:
        # the scheduler's state can no longer be trusted, so the engine stops serving
        self.fatal = f"{type(exc).__name__}: {exc}"
        print(f"[kvledger serve] engine fault, failing every open request: {self.fatal}", file=sys.stderr, flush=True)
        self._fail_all(f"internal engine error: {self.fatal}", 500)

    def _fail_all(self, message: str, status: int) -> None:
        for sink in list(self._sinks.values()):
            self._counts["failed"] += 1
            _send(sink, Failed(message, status))
        self._sinks.clear()
        self._prompt_len.clear()

    def _check_idle(self) -> None:
        self._dirty = False
        error = None
        try:
            self.scheduler.check_idle()
            if self.llm.shadow is not None:
                self.llm.shadow.model.check()  # the reference model's own view of the same invariants
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        free, cached, locked = self._pages()
        total = self.scheduler.config.num_pages
        leaked = total - free - cached
        ok = error is None and leaked == 0 and locked == 0
        self.integrity = IntegrityReport(ok, time.time(), self.integrity.checks + 1, total, free, cached, leaked,
                                         locked, error)
        if not ok:
            print(f"[kvledger serve] idle integrity check failed: {self.integrity}", file=sys.stderr, flush=True)

    def _pages(self) -> Tuple[int, int, int]:
        cm = self.scheduler.driver.cm
        ps = self.scheduler.config.page_size
        size = cm.prefix_cache.size_info
        return len(cm.free_slots), -(-size.total_size // ps), size.protected_size

    def _publish(self) -> None:
        d = self.scheduler.driver
        free, cached, locked = self._pages()
        total = self.scheduler.config.num_pages
        now = time.monotonic()
        while self._rate and self._rate[0][0] < now - RATE_WINDOW_S:
            self._rate.popleft()
        span = max(1.0, now - self._rate[0][0]) if self._rate else RATE_WINDOW_S
        c = self._counts
        self.stats = EngineStats(
            running=len(d.dm.running_reqs), waiting=len(d.waiting), total_pages=total, free_pages=free,
            cached_pages=cached, owned_pages=total - free - cached, locked_tokens=locked,
            prompt_tokens=c["prompt_tokens"], prefix_hit_tokens=c["prefix_hit_tokens"],
            generated_tokens=c["generated_tokens"], tokens_per_s=sum(n for _, n in self._rate) / span,
            cache_ops=self.scheduler.step_no, finished=c["finished"], aborted=c["aborted"], rejected=c["rejected"],
            failed=c["failed"], verified_ops=self.llm.shadow.steps if self.llm.shadow is not None else None)


def _send(sink: Sink, event: Event) -> None:
    try:
        sink(event)
    except Exception:  # a closed event loop at shutdown; the engine thread must go on
        pass
