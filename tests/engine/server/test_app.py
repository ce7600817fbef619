"""The HTTP app in-process: a 500 tells the client only "internal error" and a request id (the
detail goes to the log), and prompts are tokenized off the event loop, with text obviously over
the context refused by size before it is tokenized."""

from __future__ import annotations

import asyncio
import logging

import pytest
from fastapi.testclient import TestClient

from kvledger.engine.server.app import create_app
from kvledger.engine.server.worker import EngineWorker

MODEL = "test-model"


class CountingTokenizer:
    """The real tokenizer, recording where and how often it encodes; `fail` makes encode raise."""

    def __init__(self, real, fail: bool = False) -> None:
        self.real, self.fail, self.calls, self.on_loop = real, fail, 0, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _record(self) -> None:
        self.calls += 1
        try:
            asyncio.get_running_loop()
            self.on_loop.append(True)
        except RuntimeError:
            self.on_loop.append(False)
        if self.fail:
            raise RuntimeError("secret detail from deep inside")

    def encode(self, text, **kw):
        self._record()
        return self.real.encode(text, **kw)

    def apply_chat_template(self, messages):
        self._record()
        return self.real.apply_chat_template(messages)


@pytest.fixture(scope="module")
def llm():
    from kvledger.engine.runtime.llm import LLM

    return LLM(max_seq_len=256, kv_cache_tokens=1024)


def client_for(llm, tokenizer) -> TestClient:
    llm.tokenizer = tokenizer
    app = create_app(EngineWorker(llm), model_name=MODEL)
    return TestClient(app, raise_server_exceptions=False)


def test_a_500_hides_its_detail_and_logs_it(llm, caplog):
    real = llm.tokenizer
    try:
        with client_for(llm, CountingTokenizer(real, fail=True)) as client, caplog.at_level(logging.ERROR):
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    finally:
        llm.tokenizer = real
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["message"].startswith("internal error (request id err-") and err["type"] == "server_error"
    assert "secret" not in r.text and "RuntimeError" not in r.text
    rid = err["message"].split("request id ")[1].rstrip(")")
    assert any(rid in rec.getMessage() and rec.exc_info for rec in caplog.records)


def test_prompts_are_tokenized_off_the_loop_and_huge_ones_not_at_all(llm):
    real = llm.tokenizer
    counting = CountingTokenizer(real)
    try:
        with client_for(llm, counting) as client:
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": "word " * 700_000, "max_tokens": 1})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert counting.calls == 0  # refused by size alone
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 2})
            assert r.status_code == 200, r.text
            r = client.post(
                "/v1/chat/completions",
                json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
            )
            assert r.status_code == 200, r.text
    finally:
        llm.tokenizer = real
    assert counting.calls == 2 and not any(counting.on_loop)
