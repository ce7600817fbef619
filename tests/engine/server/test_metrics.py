"""/metrics through prometheus_client: after a few requests (streaming and not) the latency and
length histograms hold one observation per request (one per token after the first for the
inter-token latency), the finish-reason counter adds up, the old gauges and counters are still
there, each server has its own registry, and aborts and faults end in their own reason."""

from __future__ import annotations

import json
import queue
import time
from typing import Dict, List

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvledger.engine.server.app import create_app
from kvledger.engine.server.metrics import ServerMetrics
from kvledger.engine.server.worker import Accepted, EngineWorker, Failed, Token
from kvledger.fast import SamplingParams

MODEL = "test-model"
HISTOGRAMS = (
    "kvledger:time_to_first_token_seconds",
    "kvledger:inter_token_latency_seconds",
    "kvledger:e2e_request_latency_seconds",
    "kvledger:request_queue_time_seconds",
    "kvledger:request_prompt_tokens",
    "kvledger:request_generation_tokens",
)


def scrape(text: str) -> Dict[str, Dict[str, float]]:
    """{family: {sample name{labels}: value}}, parsed by prometheus_client (invalid text raises)."""
    out: Dict[str, Dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        samples = out.setdefault(family.name, {})
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def histogram(m: Dict[str, Dict[str, float]], name: str) -> Dict[str, float]:
    """count, sum, and the buckets of one histogram; the buckets are cumulative and end at count."""
    fam = m[name]
    buckets = [v for k, v in fam.items() if k.startswith(f"{name}_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == fam[f"{name}_count"], (name, fam)
    return {"count": fam[f"{name}_count"], "sum": fam[f"{name}_sum"]}


def reasons(m: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    fam = m["kvledger:request_success"]
    return {k.split("=")[1].rstrip("}"): v for k, v in fam.items() if k.startswith("kvledger:request_success_total")}


# -- over HTTP: a real model, completions and chat, streaming and not -------------------------------
@pytest.fixture(scope="module")
def llm():
    from kvledger.engine.runtime.llm import LLM

    return LLM(max_seq_len=256, kv_cache_tokens=1024)


def stream(client: TestClient, path: str, body: dict) -> List[dict]:
    chunks = []
    with client.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def finish_reason(chunks: List[dict]) -> str:
    return next(c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])


def test_histograms_count_what_the_requests_did(llm):
    worker = EngineWorker(llm)
    app = create_app(worker, model_name=MODEL)
    greedy = {"model": MODEL, "temperature": 0, "ignore_eos": True}
    usages, finishes = [], []
    with TestClient(app) as client:
        for prompt, n in (("The capital of France is", 5), ("Count: one, two, three,", 7)):
            r = client.post("/v1/completions", json={**greedy, "prompt": prompt, "max_tokens": n}).json()
            usages.append(r["usage"])
            finishes.append(r["choices"][0]["finish_reason"])
        chunks = stream(
            client, "/v1/chat/completions", {**greedy, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}
        )
        usages.append(chunks[-1]["usage"])
        finishes.append(finish_reason(chunks))
        # a stop string: the server ends the engine's request early, and counts it as "stop"
        whole = client.post("/v1/completions", json={**greedy, "prompt": "One, two,", "max_tokens": 12}).json()
        stop = whole["choices"][0]["text"].strip()[:4]
        chunks = stream(client, "/v1/completions", {**greedy, "prompt": "One, two,", "max_tokens": 12, "stop": stop})
        finishes.append(finish_reason(chunks))
        usages += [whole["usage"], chunks[-1]["usage"]]
        prompts = sum(u["prompt_tokens"] for u in usages)
        deadline = time.monotonic() + 30  # the last abort reaches the engine thread after the response
        while worker.stats.aborted < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        scraped = client.get("/metrics")
        text = scraped.text
    assert scraped.headers["content-type"].startswith("text/plain; version=0.0.4")
    m = scrape(text)
    n = 5
    assert finishes == ["length", "length", "length", "stop"]
    assert reasons(m) == {"stop": 1.0, "length": 4.0, "abort": 0.0, "error": 0.0}
    h = {name: histogram(m, name) for name in HISTOGRAMS}
    generated = m["kvledger_generation_tokens"]["kvledger_generation_tokens_total"]
    assert generated >= sum(u["completion_tokens"] for u in usages)
    for name in ("kvledger:time_to_first_token_seconds", "kvledger:e2e_request_latency_seconds"):
        assert h[name]["count"] == n and h[name]["sum"] > 0, name
    assert h["kvledger:request_queue_time_seconds"]["count"] == n
    assert h["kvledger:inter_token_latency_seconds"]["count"] == generated - n
    assert h["kvledger:request_prompt_tokens"] == {"count": n, "sum": prompts}
    assert h["kvledger:request_generation_tokens"] == {"count": n, "sum": generated}
    # the end-to-end latency of a request covers its first token and every gap after it
    e2e = h["kvledger:e2e_request_latency_seconds"]["sum"]
    assert e2e >= h["kvledger:time_to_first_token_seconds"]["sum"] + h["kvledger:inter_token_latency_seconds"]["sum"]
    # today's figures, same names
    assert m["kvledger_requests"]["kvledger_requests_total{outcome=finished}"] == 4
    assert m["kvledger_requests"]["kvledger_requests_total{outcome=aborted}"] == 1
    assert m["kvledger_prompt_tokens"]["kvledger_prompt_tokens_total"] == prompts
    for gauge in ("kvledger_requests_running", "kvledger_pages_free", "kvledger_engine_healthy"):
        assert gauge in m, gauge
    assert m["kvledger_integrity_ok"]["kvledger_integrity_ok"] == 1
    assert m["kvledger_http_responses"]["kvledger_http_responses_total{route=/v1/completions,status=200}"] == 4


# -- the engine thread alone: dummy weights ---------------------------------------------------------
@pytest.fixture(scope="module")
def dummy():
    from kvledger.engine.runtime.llm import LLM

    return LLM(dummy_weights=True, kv_cache_tokens=512, max_seq_len=128)


class Inbox:
    def __init__(self) -> None:
        self.q: "queue.Queue" = queue.Queue()

    def __call__(self, event) -> None:
        self.q.put(event)

    def get(self, timeout: float = 30.0):
        return self.q.get(timeout=timeout)


def test_each_server_has_its_own_registry(dummy):
    a, b = EngineWorker(dummy), EngineWorker(dummy)
    ma, mb = ServerMetrics(a, {}), ServerMetrics(b, {("/v1/completions", 200): 3})  # no duplicate-series error
    a.start()
    try:
        inbox = Inbox()
        a.submit(list(range(10, 20)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), inbox)
        events = [inbox.get() for _ in range(5)]
        assert isinstance(events[0], Accepted) and all(isinstance(e, Token) for e in events[1:])
    finally:
        a.stop()
    sa, sb = scrape(ma.render().decode()), scrape(mb.render().decode())
    assert histogram(sa, "kvledger:time_to_first_token_seconds")["count"] == 1
    assert histogram(sa, "kvledger:inter_token_latency_seconds")["count"] == 3
    assert histogram(sb, "kvledger:time_to_first_token_seconds")["count"] == 0
    assert "kvledger_http_responses_total{route=/v1/completions,status=200}" in sb["kvledger_http_responses"]
    assert sa["kvledger_http_responses"] == {}


def test_aborts_and_faults_end_in_their_reason(dummy, monkeypatch):
    w = EngineWorker(dummy)
    metrics = ServerMetrics(w, {})
    for inbox in [Inbox() for _ in range(3)]:  # queued before the thread starts: aborted before any step
        w.abort(w.submit(list(range(10, 20)), SamplingParams(temperature=0.0, max_tokens=4), inbox))
    w.start()
    try:
        running = Inbox()
        w.submit(list(range(30, 50)), SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), running)
        assert isinstance(running.get(), Accepted) and isinstance(running.get(), Token)

        def broken_step():
            raise RuntimeError("injected fault")

        monkeypatch.setattr(w.engine, "step", broken_step)
        while not isinstance(running.get(), Failed):
            pass
        deadline = time.monotonic() + 30  # the worker publishes its figures after failing the request
        while w.stats.failed < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        m = scrape(metrics.render().decode())
    finally:
        w.stop()
        monkeypatch.undo()
        for uid in list(w.engine.requests):  # leave the shared engine clean for other tests
            w.engine.abort(uid)
    assert reasons(m) == {"stop": 0.0, "length": 0.0, "abort": 3.0, "error": 1.0}
    assert histogram(m, "kvledger:e2e_request_latency_seconds")["count"] == 4
    assert histogram(m, "kvledger:request_queue_time_seconds")["count"] == 1
    assert histogram(m, "kvledger:time_to_first_token_seconds")["count"] == 1
    assert histogram(m, "kvledger:request_prompt_tokens") == {"count": 4, "sum": 3 * 10 + 20}


def test_an_injected_fault_is_counted_by_kind_and_its_requests_end_in_error():
    from kvledger.engine.runtime.llm import LLM

    # forward-raise at the second step: the first request's prefill ran, the step that fails holds both
    llm = LLM(dummy_weights=True, kv_cache_tokens=512, max_seq_len=128, inject_fault="forward-raise@step=2")
    w = EngineWorker(llm)
    metrics = ServerMetrics(w, {})
    inboxes = [Inbox(), Inbox()]
    for inbox in inboxes:
        w.submit(list(range(10, 22)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), inbox)
    w.start()
    try:
        ends = []
        for inbox in inboxes:
            while not isinstance(event := inbox.get(), Failed) and not (isinstance(event, Token) and event.finished):
                pass
            ends.append(event)
        deadline = time.monotonic() + 30
        while w.stats.failed + w.stats.finished < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        m = scrape(metrics.render().decode())
    finally:
        w.stop()
    failed = sum(isinstance(e, Failed) for e in ends)
    assert failed >= 1
    assert m["kvledger_faults"]["kvledger_faults_total{kind=forward_raise}"] == 1
    assert reasons(m)["error"] == failed and reasons(m)["length"] == 2 - failed
    assert histogram(m, "kvledger:e2e_request_latency_seconds")["count"] == 2
