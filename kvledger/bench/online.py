"""`kvledger bench --serve URL`: the online serving benchmark (in the style of sglang.bench_serving /
vllm bench serve).

Sends seeded random token-id prompts to a running server's /v1/completions with streaming, at a
Poisson request rate or all at once, optionally under a concurrency cap. Prompts can share
prefixes (`--shared-prefix-len` tokens common to each of `--prefix-groups` groups) to exercise
the prefix cache. Every request generates exactly `--output-len` tokens (greedy, EOS ignored).
Reports request and token throughput, TTFT, TPOT, inter-token latency and end-to-end latency
(mean, p50, p90, p99), and the server's prefix hit rate over the run (from /metrics).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence

import httpx

from kvledger.bench.workloads import Workload
from kvledger.engine.server.metrics import parse as parse_metrics


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds to the first streamed text
    latency: float = 0.0  # seconds to the end of the stream
    itl: List[float] = field(default_factory=list)  # gaps between streamed chunks
    error: str = ""

    @property
    def tpot(self) -> Optional[float]:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: List[int], max_tokens: int) -> RequestResult:
    result = RequestResult(prompt_len=len(prompt))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no usage reported"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _arrivals(n: int, rate: float, rng: random.Random) -> AsyncIterator[int]:
    """Yield 0..n-1 at Poisson arrivals of `rate` per second (inf: all at once)."""
    for i in range(n):
        yield i
        if math.isfinite(rate) and rate > 0:
            await asyncio.sleep(rng.expovariate(rate))


async def _fetch_metrics(client: httpx.AsyncClient, base: str) -> Dict[str, float]:
    try:
        r = await client.get(f"{base}/metrics")
        return parse_metrics(r.text) if r.status_code == 200 else {}
    except httpx.HTTPError:
        return {}


async def run_online(
    base_url: str,
    workload: Workload,
    *,
    request_rate: float = math.inf,
    max_concurrency: Optional[int] = None,
    api_key: Optional[str] = None,
    model: Optional[str] = None,
    seed: int = 0,
    progress: bool = True,
    timeout: float = 600.0,
) -> Dict:
    """Send the workload's requests (streaming completions, greedy, EOS ignored) to the server at
    base_url; the summary of the run."""
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(workload), max_keepalive_connections=64)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        if model is None:
            r = await client.get(f"{base}/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        before = await _fetch_metrics(client, base)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = _progress(len(workload), progress)

        async def limited(i: int) -> RequestResult:
            prompt, max_tokens = workload.prompts[i], workload.max_tokens[i]
            if gate is None:
                res = await _one(client, f"{base}/v1/completions", model, prompt, max_tokens)
            else:
                async with gate:
                    res = await _one(client, f"{base}/v1/completions", model, prompt, max_tokens)
            if bar is not None:
                bar.update(1)
            return res

        start = time.perf_counter()
        tasks = [
            asyncio.create_task(limited(i)) async for i in _arrivals(len(workload), request_rate, random.Random(seed))
        ]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
        after = await _fetch_metrics(client, base)
    return summarize(results, duration, request_rate, max_concurrency, model, before, after)


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr)


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _dist(values: Sequence[float]) -> Dict[str, float]:
    ms = [v * 1000 for v in values]
    return {"mean": sum(ms) / len(ms) if ms else 0.0, "p50": _pct(ms, 50), "p90": _pct(ms, 90), "p99": _pct(ms, 99)}


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    request_rate: float,
    max_concurrency: Optional[int],
    model: str,
    before: Dict[str, float],
    after: Dict[str, float],
) -> Dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    prompt_delta = after.get("kvledger_prompt_tokens_total", 0) - before.get("kvledger_prompt_tokens_total", 0)
    hit_delta = after.get("kvledger_prefix_hit_tokens_total", 0) - before.get("kvledger_prefix_hit_tokens_total", 0)
    return {
        "model": model,
        "request_rate": "inf" if not math.isfinite(request_rate) else request_rate,
        "max_concurrency": max_concurrency,
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_throughput": in_tokens / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "prefix_hit_rate": hit_delta / prompt_delta if prompt_delta > 0 else None,
        "ttft_ms": _dist([r.ttft for r in ok]),
        "tpot_ms": _dist([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _dist([g for r in ok for g in r.itl]),
        "e2e_latency_ms": _dist([r.latency for r in ok]),
    }


def format_report(s: Dict) -> str:
    w = 44
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w + 12, c="=")]

    def row(label: str, value) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<{w}}{text:>12}")

    row("Model:", s["model"])
    row("Request rate (req/s):", s["request_rate"])
    row("Max concurrency:", s["max_concurrency"] or "none")
    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["input_tokens"])
    row("Total generated tokens:", s["output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    row("Input token throughput (tok/s):", s["input_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    if s["prefix_hit_rate"] is not None:
        row("Prefix cache hit rate (server):", f"{100 * s['prefix_hit_rate']:.1f}%")
    for key, short, title in (
        ("ttft_ms", "TTFT", "Time to First Token"),
        ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
        ("itl_ms", "ITL", "Inter-token Latency"),
        ("e2e_latency_ms", "E2EL", "End-to-end Latency"),
    ):
        lines.append("{s:{c}^{n}}".format(s=f" {title} ", n=w + 12, c="-"))
        d = s[key]
        row(f"Mean {short} (ms):", d["mean"])
        for q in ("p50", "p90", "p99"):
            row(f"{q.upper()} {short} (ms):", d[q])
    lines.append("=" * (w + 12))
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)
