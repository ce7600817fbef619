"""Load on a real `kvledger serve --verify` process: 64 concurrent streaming clients (official
AsyncOpenAI client) over shared prefixes and mixed lengths, a fifth of them hanging up mid-stream,
bad requests mixed in. Every request is answered or cleanly aborted; afterwards the server goes
idle and its integrity check proves that no page leaked and no lock is held. Then the online
benchmark runs against the same server."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx  # noqa: E402
import openai  # noqa: E402  (a declared dependency: a missing install must fail, not skip)
import pytest

from kvledger.bench import online as bench_online  # noqa: E402
from kvledger.bench.workloads import online as online_workload  # noqa: E402
from kvledger.cli import main as kvledger_main  # noqa: E402
from kvledger.engine.server.launch import ServerProcess  # noqa: E402
from kvledger.engine.server.metrics import parse as parse_metrics  # noqa: E402

KEY = "load-key"
MODEL = "SmolLM2-135M-Instruct"
CLIENTS = 64
KV_TOKENS = 3072  # 192 pages: less than the load's worst case, so requests queue and the cache evicts
PREFIXES = [
    "You are a careful assistant for a shipping company. Answer in one short sentence. ",
    "Background: the river rises every spring, flooding the lower town and the old mill. ",
    "Rules of the game: each player draws two cards, then may trade one card with the deck. ",
    "System notice: all replies are logged. Be polite, brief and precise in every answer. ",
]


@dataclass
class Outcome:
    kind: str  # "done", "aborted" or "bad"
    tokens: int = 0
    finish_reason: str = ""


@pytest.fixture(scope="module")
def server():
    with ServerProcess(
        ["--api-key", KEY, "--verify", "--max-seq-len", "1024", "--kv-cache-tokens", str(KV_TOKENS)]
    ) as srv:
        yield srv


def metrics(server) -> dict:
    return parse_metrics(httpx.get(f"{server.url}/metrics", timeout=10).text)


def integrity(server) -> dict:
    return httpx.get(f"{server.url}/debug/integrity", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()


async def one_client(client: "openai.AsyncOpenAI", i: int, rng: random.Random) -> Outcome:
    prefix = PREFIXES[i % len(PREFIXES)]
    suffix = " ".join(f"item{rng.randrange(1000)}" for _ in range(rng.randint(1, 60)))
    max_tokens = rng.randint(4, 16)
    abort_after = rng.randint(0, 2) if i % 5 == 0 else None  # a fifth hang up after 0..2 chunks
    if abort_after is not None:
        max_tokens = 16
    extra = {"ignore_eos": True}
    if i % 3 == 0:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": prefix}, {"role": "user", "content": suffix}],
            max_tokens=max_tokens,
            temperature=0.0 if i % 2 else 0.8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
    else:
        stream = await client.completions.create(
            model=MODEL,
            prompt=prefix + suffix,
            max_tokens=max_tokens,
            temperature=0.0 if i % 2 else 0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
    chunks, finish, usage = 0, "", None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            chunks += 1
            finish = chunk.choices[0].finish_reason or finish
        if abort_after is not None and chunks > abort_after:
            await stream.close()  # hang up mid-stream
            return Outcome("aborted")
    assert usage is not None, f"client {i}: no usage chunk"
    return Outcome("done", usage.completion_tokens, finish)


async def bad_client(client: "openai.AsyncOpenAI", i: int) -> Outcome:
    bad = [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=2.0), dict(max_tokens=5000)][i % 4]
    try:
        await client.completions.create(model=MODEL, prompt="bad", **bad)
    except openai.BadRequestError as e:
        assert e.status_code == 400 and next(iter(bad)) in str(e)
        return Outcome("bad")
    raise AssertionError(f"bad request {bad} was accepted")


async def load(server) -> list:
    rng = random.Random(1234)
    client = openai.AsyncOpenAI(
        base_url=f"{server.url}/v1",
        api_key=KEY,
        max_retries=0,
        timeout=300,
        http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=CLIENTS + 16)),
    )
    async with client:
        jobs = [one_client(client, i, rng) for i in range(CLIENTS)] + [bad_client(client, i) for i in range(8)]
        return await asyncio.gather(*jobs)


def test_64_streaming_clients_with_aborts_leave_no_leak(server):
    before = metrics(server)
    checks = integrity(server)["integrity"]["checks"]
    started = time.monotonic()
    outcomes = asyncio.run(asyncio.wait_for(load(server), timeout=420))
    elapsed = time.monotonic() - started

    done = [o for o in outcomes if o.kind == "done"]
    aborted = [o for o in outcomes if o.kind == "aborted"]
    assert len([o for o in outcomes if o.kind == "bad"]) == 8
    assert len(done) + len(aborted) == CLIENTS
    assert len(aborted) >= CLIENTS // 5
    assert all(o.finish_reason == "length" and o.tokens >= 4 for o in done)

    # the server goes idle, and the idle check after the load proves the partition
    deadline = time.monotonic() + 60
    while True:
        state = integrity(server)
        eng = state["engine"]
        if eng["running"] == 0 and eng["waiting"] == 0 and state["integrity"]["checks"] > checks:
            break
        assert time.monotonic() < deadline, f"server never went idle: {state}"
        time.sleep(0.1)
    after = metrics(server)
    report = state["integrity"]
    assert report["ok"], report
    assert report["error"] is None
    assert report["leaked_pages"] == 0 and report["locked_tokens"] == 0
    assert report["free_pages"] + report["cached_pages"] == report["total_pages"] == KV_TOKENS // 16
    assert after["kvledger_integrity_ok"] == 1 and after["kvledger_pages_owned"] == 0
    assert after["kvledger_cached_tokens_locked"] == 0
    assert after["kvledger_engine_healthy"] == 1 and state["fault"] is None

    def delta(outcome: str) -> float:
        key = f'kvledger_requests_total{{outcome="{outcome}"}}'
        return after[key] - before[key]

    # every accepted request ended in the engine as finished or aborted; none failed
    assert delta("finished") + delta("aborted") == CLIENTS
    assert delta("failed") == 0
    # a hang-up can lose the race against the request's last token, but most land mid-generation
    assert 1 <= delta("aborted") <= len(aborted)
    assert after["kvledger_verified_operations_total"] > before["kvledger_verified_operations_total"]
    assert after["kvledger_prefix_hit_tokens_total"] > before["kvledger_prefix_hit_tokens_total"]
    print(
        f"\nload: {CLIENTS} streams + 8 bad in {elapsed:.1f} s; client hang-ups {len(aborted)}, "
        f"engine aborts {delta('aborted'):.0f}, finished {delta('finished'):.0f}, failed {delta('failed'):.0f}, "
        f"leaked pages {report['leaked_pages']}, free {report['free_pages']} + cached {report['cached_pages']} "
        f"= {report['total_pages']}, prefix hit rate {after['kvledger_prefix_hit_rate']:.2f}"
    )


def test_online_benchmark_against_the_server(server, capsys):
    reqs = online_workload(12, 8, 48, 6, shared_prefix_len=32, prefix_groups=2, seed=3)
    summary = asyncio.run(
        bench_online.run_online(
            server.url, reqs, request_rate=20.0, max_concurrency=8, api_key=KEY, progress=False, timeout=120
        )
    )
    assert summary["completed"] == 12 and summary["failed"] == 0, summary["errors"]
    assert summary["output_tokens"] == 12 * 6
    assert summary["ttft_ms"]["p50"] > 0 and summary["itl_ms"]["p99"] >= summary["itl_ms"]["p50"] > 0
    assert summary["prefix_hit_rate"] is not None and summary["prefix_hit_rate"] > 0
    report = bench_online.format_report(summary)
    assert "Serving Benchmark Result" in report and "P99 TTFT (ms):" in report

    code = kvledger_main(
        [
            "bench",
            "--serve",
            server.url,
            "--api-key",
            KEY,
            "--prompts",
            "4",
            "--min-len",
            "4",
            "--max-len",
            "8",
            "--output-len",
            "3",
            "--no-progress",
        ]
    )
    assert code == 0 and "Successful requests:" in capsys.readouterr().out
