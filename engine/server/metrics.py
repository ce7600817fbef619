"""/metrics: the engine's published figures, the last idle integrity check, the HTTP responses, and
the requests' latency histograms (request_timing.py), through prometheus_client.

Each server has its own `CollectorRegistry` (`ServerMetrics`), so several servers in one process
(tests) never share a series. The figures the engine thread publishes (`EngineStats`, an immutable
snapshot) are read at scrape time by a custom collector: counters and gauges with the names they
have always had (`kvledger_*`); the histograms and the finish-reason counter are prometheus_client
metrics the engine thread observes into, named after vLLM's (`kvledger:*` for `vllm:*`). The
mapping to vLLM's names is the table in docs/serving.md.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from kvledger.engine.server.request_timing import RequestTiming
from kvledger.engine.server.worker import EngineStats, EngineWorker, IntegrityReport

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FAULT_PREFIX = "faults_"  # the worker publishes faults by kind as EngineStats.faults[faults_<kind>]

# name, type, help, value
_Figure = Tuple[str, str, str, float]


def _engine_figures(s: EngineStats, healthy: bool) -> List[_Figure]:
    hit_rate = s.prefix_hit_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
    out: List[_Figure] = [
        ("kvledger_engine_healthy", "gauge", "1 while the engine thread runs and has had no fault", float(healthy)),
        ("kvledger_requests_running", "gauge", "requests in the decode batch", s.running),
        ("kvledger_requests_waiting", "gauge", "requests queued for prefill (including mid-chunk)", s.waiting),
        ("kvledger_pages_total", "gauge", "KV pages in the pool", s.total_pages),
        ("kvledger_pages_free", "gauge", "KV pages on the free list", s.free_pages),
        ("kvledger_pages_cached", "gauge", "KV pages held by the prefix cache", s.cached_pages),
        ("kvledger_pages_owned", "gauge", "KV pages held by live requests outside the prefix cache", s.owned_pages),
        ("kvledger_cached_tokens_locked", "gauge", "prefix-cache tokens locked by live requests", s.locked_tokens),
        ("kvledger_prompt_tokens", "counter", "prompt tokens of admitted requests that ended", s.prompt_tokens),
        ("kvledger_prefix_hit_tokens", "counter", "of those, tokens found in the prefix cache", s.prefix_hit_tokens),
        ("kvledger_prefix_hit_rate", "gauge", "prefix_hit_tokens_total / prompt_tokens_total", hit_rate),
        ("kvledger_generation_tokens", "counter", "tokens generated", s.generated_tokens),
        (
            "kvledger_generation_tokens_per_second",
            "gauge",
            "tokens generated per second over the last 10 s",
            s.tokens_per_s,
        ),
        ("kvledger_cache_operations", "counter", "operations applied to the cache manager", s.cache_ops),
        ("kvledger_preemptions", "counter", "requests preempted to make room (optimistic admission)", s.preemptions),
        (
            "kvledger_recomputed_tokens",
            "counter",
            "KV positions computed again after a preemption (not found in the prefix cache)",
            s.recomputed_tokens,
        ),
    ]
    if s.verified_ops is not None:
        out.append(
            (
                "kvledger_verified_operations",
                "counter",
                "cache operations mirrored and matched in the reference model (--verify)",
                s.verified_ops,
            )
        )
    return out


def _integrity_figures(r: IntegrityReport) -> List[_Figure]:
    return [
        ("kvledger_integrity_ok", "gauge", "1 if the last idle integrity check passed (no leak, no lock)", float(r.ok)),
        ("kvledger_integrity_checks", "counter", "idle integrity checks run", r.checks),
        ("kvledger_integrity_last_check_timestamp_seconds", "gauge", "unix time of the last idle check", r.checked_at),
        (
            "kvledger_integrity_leaked_pages",
            "gauge",
            "pages neither free nor cached at the last idle check",
            r.leaked_pages,
        ),
        (
            "kvledger_integrity_locked_tokens",
            "gauge",
            "cached tokens still locked at the last idle check",
            r.locked_tokens,
        ),
    ]


def _family(name: str, kind: str, help_: str, value: float) -> Metric:
    if kind == "counter":
        return CounterMetricFamily(name, help_, value=value)
    return GaugeMetricFamily(name, help_, value=value)


class _ServerCollector(Collector):
    """Reads, at each scrape, what the engine thread last published and the app's response counts."""

    def __init__(self, worker: EngineWorker, http_responses: Mapping[Tuple[str, int], int]) -> None:
        self.worker = worker
        self.http_responses = http_responses

    def collect(self) -> Iterator[Metric]:
        worker = self.worker
        stats = worker.stats  # one immutable snapshot: every figure of a scrape from the same moment
        for figure in _engine_figures(stats, worker.alive) + _integrity_figures(worker.integrity):
            yield _family(*figure)
        outcomes = CounterMetricFamily(
            "kvledger_requests", "requests that ended in the engine, by outcome", labels=["outcome"]
        )
        for outcome in ("finished", "aborted", "rejected", "failed"):
            outcomes.add_metric([outcome], getattr(stats, outcome))
        yield outcomes
        faults = CounterMetricFamily("kvledger_faults", "faults inside the engine, by kind", labels=["kind"])
        for kind, n in sorted(fault_counts(stats).items()):
            faults.add_metric([kind], n)
        yield faults
        http = CounterMetricFamily(
            "kvledger_http_responses", "HTTP responses on /v1, by route and status", labels=["route", "status"]
        )
        for (route, status), n in sorted(dict(self.http_responses).items()):
            http.add_metric([route, str(status)], n)
        yield http
        timing: Optional[RequestTiming] = getattr(worker, "timing", None)
        if timing is not None:
            yield from timing.collect()


def fault_counts(stats: EngineStats) -> Dict[str, int]:
    """{kind: n} from the published `faults_<kind>` counts (none until a fault strikes)."""
    counts: Mapping[str, int] = getattr(stats, "faults", None) or {}
    return {k[len(FAULT_PREFIX) :]: int(v) for k, v in counts.items() if k.startswith(FAULT_PREFIX)}


class ServerMetrics:
    """One server's registry: `render()` is the body of GET /metrics."""

    def __init__(self, worker: EngineWorker, http_responses: Mapping[Tuple[str, int], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_ServerCollector(worker, http_responses))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def integrity_json(integrity: IntegrityReport, stats: EngineStats, fatal: Optional[str]) -> Dict:
    return {"integrity": asdict(integrity), "engine": asdict(stats), "fault": fatal}


def parse(text: str) -> Dict[str, float]:
    """Prometheus text -> {name or name{labels}: value} (labels as exposed, in order); for tests and
    the benchmark. Parsed by prometheus_client, so a scrape that is not valid exposition raises."""
    out: Dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sample.labels.items())
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
