"""`kvledger serve` as a real process on loopback, through the official openai client and raw HTTP:
completions, chat, streaming, greedy output equal to LLM.generate, stop strings, aborts that
free pages at once, every kind of bad request, and the API key."""

from __future__ import annotations

import json
import socket
import time

import httpx  # noqa: E402
import openai  # noqa: E402  (a declared dependency: a missing install must fail, not skip)
import pytest

from kvledger.engine.server.launch import ServerProcess  # noqa: E402
from kvledger.engine.server.metrics import parse as parse_metrics  # noqa: E402

KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
MAX_SEQ_LEN = 512
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(
        ["--api-key", KEY, "--verify", "--max-seq-len", str(MAX_SEQ_LEN), "--kv-cache-tokens", "4096"]
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm():
    from kvledger.engine.runtime.llm import LLM

    return LLM(max_seq_len=MAX_SEQ_LEN, kv_cache_tokens=4096)


def greedy(llm, prompt, max_tokens):
    from kvledger.fast import SamplingParams

    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)[0]
    return out.text, len(out.token_ids), out.finish_reason


def engine_state(server) -> dict:
    return httpx.get(f"{server.url}/debug/integrity", headers=AUTH, timeout=10).json()


def wait_idle(server, since_checks: int, timeout: float = 30.0) -> dict:
    """Until nothing runs or waits and an idle integrity check ran after `since_checks`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = engine_state(server)
        eng = state["engine"]
        if eng["running"] == 0 and eng["waiting"] == 0 and state["integrity"]["checks"] > since_checks:
            return state
        time.sleep(0.1)
    raise AssertionError(f"server did not go idle: {engine_state(server)}")


# -- the API -------------------------------------------------------------------------------------
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_completion_greedy_matches_llm_generate(client, llm):
    prompt = "The three primary colors are"
    want, n, reason = greedy(llm, prompt, 24)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == reason
    assert r.usage.completion_tokens == n and r.usage.prompt_tokens == len(llm.tokenizer.encode(prompt))

    pieces, reasons = [], []
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            reasons.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == want
    assert reasons[-1] == reason and len(pieces) > 2


def test_token_id_prompt(client, llm):
    ids = llm.tokenizer.encode("Paris is the capital of")
    want, _, _ = greedy(llm, ids, 8)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == want


def test_chat_greedy_matches_llm_generate(client, llm):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}]
    want, n, reason = greedy(llm, llm.tokenizer.apply_chat_template(messages), 20)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == reason and r.usage.completion_tokens == n

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
    assert chunks[-1].usage.completion_tokens == n and chunks[-1].choices == []


def test_repeated_prompt_hits_prefix_cache(client):
    prompt = "A long shared system preamble about the rules of the game. " * 4
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16


def test_sampling_with_seed_is_reproducible(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_tiny_temperature_is_greedy(client, llm):
    want, _, _ = greedy(llm, "Water boils at", 6)
    r = client.completions.create(model=MODEL, prompt="Water boils at", max_tokens=6, temperature=1e-300)
    assert r.choices[0].text == want


def test_stop_strings(client, llm):
    prompt = "The capital of France is"
    full, _, _ = greedy(llm, prompt, 24)
    stop = full.strip().split()[2]  # a word in the middle of the greedy answer
    want = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    chunks = list(
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


# -- aborts ----------------------------------------------------------------------------------------
def test_abort_mid_stream_frees_pages_at_once_and_spares_others(server, client):
    checks = engine_state(server)["integrity"]["checks"]
    before = parse_metrics(httpx.get(f"{server.url}/metrics").text)
    other = client.completions.create(
        model=MODEL,
        prompt="Count with me: one, two,",
        max_tokens=40,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    body = {
        "model": MODEL,
        "prompt": "Write a very long story about a dragon.",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(headers=AUTH, timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = []
            for line in lines:
                if line.startswith("data: "):
                    got.append(line)
                    if len(got) == 3:
                        break
            eng = engine_state(server)["engine"]
            assert eng["running"] + eng["waiting"] >= 1 and eng["owned_pages"] >= 1
        # the response is closed here: the server sees the disconnect and aborts
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = parse_metrics(httpx.get(f"{server.url}/metrics").text)
            if m['kvledger_requests_total{outcome="aborted"}'] > before['kvledger_requests_total{outcome="aborted"}']:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the abort never reached the engine")
    # the other stream carries on to its full length
    chunks = [c for c in other if c.choices]
    assert chunks[-1].choices[0].finish_reason == "length"
    state = wait_idle(server, checks)
    assert state["integrity"]["ok"], state
    assert state["integrity"]["leaked_pages"] == 0 and state["integrity"]["locked_tokens"] == 0
    assert state["engine"]["owned_pages"] == 0


def test_non_streaming_client_disconnect_aborts(server):
    """A non-streaming client that goes away while its request runs gets it aborted. The client
    leaves once /metrics shows the request running (not after a fixed timeout), so the outcome
    does not depend on how fast the machine generates."""

    def metrics() -> dict:
        return parse_metrics(httpx.get(f"{server.url}/metrics", timeout=10).text)

    before = metrics()
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": "Tell me everything about the sea.",
            "max_tokens": 400,
            "temperature": 0,
            "ignore_eos": True,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(head + body)
        deadline = time.monotonic() + 30  # a safety net: the request normally runs within a second
        while metrics()["kvledger_requests_running"] < 1:
            assert time.monotonic() < deadline, "the request never started running"
            time.sleep(0.02)
    # the connection is closed while the request generates its 400 tokens
    deadline = time.monotonic() + 30
    while (now := metrics())['kvledger_requests_total{outcome="aborted"}'] == before[
        'kvledger_requests_total{outcome="aborted"}'
    ]:
        assert time.monotonic() < deadline, "the non-streaming request was not aborted"
        time.sleep(0.05)
    assert now['kvledger_requests_total{outcome="finished"}'] == before['kvledger_requests_total{outcome="finished"}']


# -- bad input -------------------------------------------------------------------------------------
LONG = "hello " * (MAX_SEQ_LEN + 50)
COMPLETION = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

BAD = [
    # (route, body (dict, or raw bytes), status, param, words in the message)
    (COMPLETION, b'{"model": "x", "prompt": ', 400, None, "not valid JSON"),
    (COMPLETION, b"[1, 2]", 400, None, "JSON object"),
    (COMPLETION, b'{"model": "' + b"x" * (5 << 20) + b'"}', 413, None, "larger than"),
    (COMPLETION, {"model": MODEL}, 400, "prompt", "prompt is required"),
    (COMPLETION, {"prompt": "hi"}, 400, "model", "model is required"),
    (COMPLETION, {"model": 3, "prompt": "hi"}, 400, "model", "must be a string"),
    (COMPLETION, {"model": "gpt-9", "prompt": "hi"}, 404, "model", "does not exist"),
    (COMPLETION, {"model": MODEL, "prompt": 42}, 400, "prompt", "string or an array"),
    (COMPLETION, {"model": MODEL, "prompt": ""}, 400, "prompt", "empty"),
    (COMPLETION, {"model": MODEL, "prompt": []}, 400, "prompt", "empty"),
    (COMPLETION, {"model": MODEL, "prompt": [1, "a"]}, 400, "prompt", "token ids"),
    (COMPLETION, {"model": MODEL, "prompt": [10**7]}, 400, "prompt", "outside the vocabulary"),
    (COMPLETION, {"model": MODEL, "prompt": LONG}, 400, "prompt", "context"),
    (COMPLETION, {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    (COMPLETION, {"model": MODEL, "prompt": "hi", "max_tokens": -5}, 400, "max_tokens", "at least 1"),
    (COMPLETION, {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    (COMPLETION, {"model": MODEL, "prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens", "integer"),
    (COMPLETION, {"model": MODEL, "prompt": "hi", "max_tokens": MAX_SEQ_LEN}, 400, "max_tokens", "context"),
    (COMPLETION, {"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, "temperature", "between 0 and 2"),
    (COMPLETION, {"model": MODEL, "prompt": "hi", "temperature": 2.5}, 400, "temperature", "between 0 and 2"),
    (COMPLETION, {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature", "number"),
    (COMPLETION, {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p", "greater than 0"),
    (COMPLETION, {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p", "at most 1"),
    (COMPLETION, {"model": MODEL, "prompt": "hi", "top_k": -3}, 400, "top_k", "top_k"),
    (COMPLETION, {"model": MODEL, "prompt": "hi", "seed": 2**70}, 400, "seed", "64 bits"),
    (COMPLETION, {"model": MODEL, "prompt": "hi", "n": 2}, 400, "n", "n must be 1"),
    (COMPLETION, {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream", "boolean"),
    (COMPLETION, {"model": MODEL, "prompt": "hi", "stop": [""]}, 400, "stop", "empty"),
    (COMPLETION, {"model": MODEL, "prompt": "hi", "logprobs": 3}, 400, "logprobs", "not supported"),
    (CHAT, {"model": MODEL}, 400, "messages", "messages is required"),
    (CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages", "array"),
    (CHAT, {"model": MODEL, "messages": []}, 400, "messages", "empty"),
    (CHAT, {"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages[0].role", "role"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "string"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": LONG}]}, 400, "messages", "context"),
    (CHAT, {"model": "nope", "messages": USER}, 404, "model", "does not exist"),
    (CHAT, {"model": MODEL, "messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens", "at least 1"),
    (CHAT, {"model": MODEL, "messages": USER, "temperature": None, "top_p": -1}, 400, "top_p", "greater than 0"),
]


@pytest.mark.parametrize(
    "route,body,status,param,words", BAD, ids=[f"{i}-{b[0].rsplit('/', 1)[-1]}-{b[3]}" for i, b in enumerate(BAD)]
)
def test_bad_request(server, route, body, status, param, words):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.url}{route}", headers={**AUTH, "Content-Type": "application/json"}, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert words.lower() in err["message"].lower(), err["message"]
    if param:
        assert param.split("[")[0].split(".")[0] in err["message"]


def test_bad_requests_leave_the_server_serving(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert e.value.status_code == 400 and "max_tokens" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nothing", messages=USER)
    r = httpx.get(f"{server.url}/v1/nowhere", headers=AUTH)
    assert r.status_code == 404 and "error" in r.json()
    assert client.completions.create(model=MODEL, prompt="Still alive?", max_tokens=3).usage.completion_tokens == 3
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_api_key_required(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/debug/integrity").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes stay open
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_metrics_exposition(server):
    text = httpx.get(f"{server.url}/metrics").text
    m = parse_metrics(text)
    for name in (
        "kvledger_requests_running",
        "kvledger_requests_waiting",
        "kvledger_pages_free",
        "kvledger_pages_cached",
        "kvledger_pages_owned",
        "kvledger_prefix_hit_rate",
        "kvledger_generation_tokens_per_second",
        "kvledger_integrity_ok",
        "kvledger_verified_operations_total",
    ):
        assert name in m, name
    assert m["kvledger_pages_total"] == 4096 // 16
    assert m["kvledger_verified_operations_total"] > 0
    assert json.loads(json.dumps(engine_state(server)))["fault"] is None
