"""Each request's life in time, as the Prometheus histograms that operators alert on.

The engine thread tells a `RequestTiming` four things: a request was accepted (with the time it
arrived at the worker), a step ran (its start time and its token events), a request was aborted,
and which requests are still open (every request that ended some other way, a fault or a drain,
ended in error). From those it observes, per request: the queue time (arrival to the step that
first scheduled it), the time to first token, each inter-token latency, the end-to-end latency,
the prompt and output lengths, and one count by finish reason.

Names and buckets follow vLLM's (vllm/v1/metrics/loggers.py: PrometheusStatLogger, buckets from
vllm/v1/metrics/buckets.py), with `kvledger:` for `vllm:`; docs/serving.md has the table. The
timestamps are `time.monotonic()` and feed these figures only: nothing the engine decides reads them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple

from prometheus_client import Counter, Histogram
from prometheus_client.metrics_core import Metric

# vllm/v1/metrics/buckets.py: TIME_TO_FIRST_TOKEN_BUCKETS, INTER_TOKEN_LATENCY_BUCKETS, REQUEST_LATENCY_BUCKETS
TTFT_BUCKETS: Tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS: Tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS: Tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error")


def token_buckets(max_seq_len: int) -> List[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_seq_len (vLLM's request_tokens family: build_1_2_5_buckets)."""
    out: List[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_seq_len:
                return out
            out.append(float(mantissa * scale))
        scale *= 10


class TokenEventLike(Protocol):
    """What a step's event carries that the timing reads (engine.runtime.requests.TokenEvent)."""

    @property
    def uid(self) -> int: ...
    @property
    def finished(self) -> bool: ...
    @property
    def finish_reason(self) -> Optional[str]: ...
    @property
    def error(self) -> Optional[str]: ...


class RecordLike(Protocol):
    @property
    def cached_tokens(self) -> Optional[int]: ...


class RecordsLike(Protocol):
    """The engine's live request records: a record's cached_tokens is set when it is first scheduled."""

    def get(self, uid: int) -> Optional[RecordLike]: ...


@dataclass
class _Life:
    arrival: float
    prompt_len: int
    last_token: Optional[float] = None
    tokens: int = 0


class RequestTiming:
    """Per-request timestamps and the histograms and counter they fill; engine thread only (a scrape
    may collect from any thread: prometheus_client's metrics hold their own locks)."""

    def __init__(self, max_seq_len: int) -> None:
        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=None)

        self.queue_time = histogram(
            "kvledger:request_queue_time_seconds",
            "Histogram of time from arrival at the engine to the step that first scheduled the request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.ttft = histogram(
            "kvledger:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "kvledger:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "kvledger:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds (arrival at the engine to the request's end).",
            REQUEST_LATENCY_BUCKETS,
        )
        lengths = token_buckets(max_seq_len)
        self.prompt_tokens = histogram(
            "kvledger:request_prompt_tokens", "Number of prefill tokens processed (per ended request).", lengths
        )
        self.generation_tokens = histogram(
            "kvledger:request_generation_tokens", "Number of generation tokens processed (per ended request).", lengths
        )
        self.finished = Counter(
            "kvledger:request_success",
            "Count of ended requests by finish reason (stop, length, abort, error), as vLLM's request_success.",
            ["finished_reason"],
            registry=None,
        )
        for reason in FINISH_REASONS:  # every reason exposed from the start, at 0
            self.finished.labels(reason)
        self._lives: Dict[int, _Life] = {}
        self._unscheduled: Dict[int, _Life] = {}

    # -- what the worker tells it --------------------------------------------------------------
    def submitted(self, uid: int, prompt_len: int, arrival: float) -> None:
        life = _Life(arrival, prompt_len)
        self._lives[uid] = life
        self._unscheduled[uid] = life

    def stepped(self, events: Iterable[TokenEventLike], started: float, records: RecordsLike) -> None:
        """After a step that began at `started`: requests it scheduled for the first time (their
        record's cached_tokens set at admission, or a token already), then its tokens and ends."""
        now = time.monotonic()
        events = list(events)
        for uid in [uid for uid, _ in self._unscheduled.items() if _admitted(records, uid)]:
            self._scheduled(uid, started)
        for ev in events:
            life = self._lives.get(ev.uid)
            if life is None:
                continue
            if ev.uid in self._unscheduled:  # admitted and ended in this very step: its record is gone
                self._scheduled(ev.uid, started)
            if ev.error is None:
                self._token(life, now)
            if ev.finished:
                reason = "error" if ev.error is not None else (ev.finish_reason or "stop")
                self.ended(ev.uid, reason, now)

    def ended(self, uid: int, reason: str, now: Optional[float] = None) -> None:
        """The request ended (an abort, or its last token): its end-to-end figures and its reason."""
        life = self._lives.pop(uid, None)
        if life is None:
            return
        self._unscheduled.pop(uid, None)
        end = time.monotonic() if now is None else now
        self.e2e.observe(end - life.arrival)
        self.prompt_tokens.observe(life.prompt_len)
        self.generation_tokens.observe(life.tokens)
        self.finished.labels(reason if reason in FINISH_REASONS else "error").inc()

    def sync(self, open_uids: Iterable[int]) -> None:
        """Requests no longer open that ended through neither a token nor an abort ended in error
        (the worker failed them: a fault, a drain's deadline)."""
        still = set(open_uids)
        for uid in [uid for uid in self._lives if uid not in still]:
            self.ended(uid, "error")

    # -- what a scrape reads --------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        for m in (self.queue_time, self.ttft, self.itl, self.e2e, self.prompt_tokens, self.generation_tokens):
            yield from m.collect()
        yield from self.finished.collect()

    # -- parts ------------------------------------------------------------------------------------
    def _scheduled(self, uid: int, started: float) -> None:
        life = self._unscheduled.pop(uid)
        self.queue_time.observe(max(0.0, started - life.arrival))

    def _token(self, life: _Life, now: float) -> None:
        if life.last_token is None:
            self.ttft.observe(now - life.arrival)
        else:
            self.itl.observe(now - life.last_token)
        life.last_token = now
        life.tokens += 1


def _admitted(records: RecordsLike, uid: int) -> bool:
    rec = records.get(uid)
    return rec is not None and rec.cached_tokens is not None
