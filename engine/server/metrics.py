"""Prometheus text exposition of the engine's published figures and the last idle integrity check."""

from __future__ import annotations

from dataclasses import asdict
from typing import Dict, List, Mapping, Optional, Tuple

from kvledger.engine.server.worker import EngineStats, IntegrityReport

# name, type, help, value getter
_Metric = Tuple[str, str, str, float]


def _engine_metrics(s: EngineStats, healthy: bool) -> List[_Metric]:
    hit_rate = s.prefix_hit_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
    out: List[_Metric] = [
        ("kvledger_engine_healthy", "gauge", "1 while the engine thread runs and has had no fault", float(healthy)),
        ("kvledger_requests_running", "gauge", "requests in the decode batch", s.running),
        ("kvledger_requests_waiting", "gauge", "requests queued for prefill (including mid-chunk)", s.waiting),
        ("kvledger_pages_total", "gauge", "KV pages in the pool", s.total_pages),
        ("kvledger_pages_free", "gauge", "KV pages on the free list", s.free_pages),
        ("kvledger_pages_cached", "gauge", "KV pages held by the prefix cache", s.cached_pages),
        ("kvledger_pages_owned", "gauge", "KV pages held by live requests outside the prefix cache", s.owned_pages),
        ("kvledger_cached_tokens_locked", "gauge", "prefix-cache tokens locked by live requests", s.locked_tokens),
        ("kvledger_prompt_tokens_total", "counter", "prompt tokens of admitted requests that ended", s.prompt_tokens),
        (
            "kvledger_prefix_hit_tokens_total",
            "counter",
            "of those, tokens found in the prefix cache",
            s.prefix_hit_tokens,
        ),
        ("kvledger_prefix_hit_rate", "gauge", "prefix_hit_tokens_total / prompt_tokens_total", hit_rate),
        ("kvledger_generation_tokens_total", "counter", "tokens generated", s.generated_tokens),
        (
            "kvledger_generation_tokens_per_second",
            "gauge",
            "tokens generated per second over the last 10 s",
            s.tokens_per_s,
        ),
        ("kvledger_cache_operations_total", "counter", "operations applied to the cache manager", s.cache_ops),
        (
            "kvledger_preemptions_total",
            "counter",
            "requests preempted to make room (optimistic admission)",
            s.preemptions,
        ),
        (
            "kvledger_recomputed_tokens_total",
            "counter",
            "KV positions computed again after a preemption (not found in the prefix cache)",
            s.recomputed_tokens,
        ),
    ]
    if s.verified_ops is not None:
        out.append(
            (
                "kvledger_verified_operations_total",
                "counter",
                "cache operations mirrored and matched in the reference model (--verify)",
                s.verified_ops,
            )
        )
    return out


def _integrity_metrics(r: IntegrityReport) -> List[_Metric]:
    return [
        ("kvledger_integrity_ok", "gauge", "1 if the last idle integrity check passed (no leak, no lock)", float(r.ok)),
        ("kvledger_integrity_checks_total", "counter", "idle integrity checks run", r.checks),
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


def render(
    stats: EngineStats, integrity: IntegrityReport, healthy: bool, http_responses: Mapping[Tuple[str, int], int]
) -> str:
    lines: List[str] = []
    for name, kind, help_, value in _engine_metrics(stats, healthy) + _integrity_metrics(integrity):
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {_fmt(value)}"]
    lines += [
        "# HELP kvledger_requests_total requests that ended in the engine, by outcome",
        "# TYPE kvledger_requests_total counter",
    ]
    for outcome in ("finished", "aborted", "rejected", "failed"):
        lines.append(f'kvledger_requests_total{{outcome="{outcome}"}} {getattr(stats, outcome)}')
    lines += [
        "# HELP kvledger_http_responses_total HTTP responses on /v1, by route and status",
        "# TYPE kvledger_http_responses_total counter",
    ]
    for (route, status), n in sorted(http_responses.items()):
        lines.append(f'kvledger_http_responses_total{{route="{route}",status="{status}"}} {n}')
    return "\n".join(lines) + "\n"


def integrity_json(integrity: IntegrityReport, stats: EngineStats, fatal: Optional[str]) -> Dict:
    return {"integrity": asdict(integrity), "engine": asdict(stats), "fault": fatal}


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def parse(text: str) -> Dict[str, float]:
    """Prometheus text -> {name or name{labels}: value}; for tests and the benchmark."""
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
