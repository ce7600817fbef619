"""Request parsing without a server: defaults, aliases, and the length checks."""

from __future__ import annotations

import pytest

from kvledger.engine.server.protocol import (  # noqa: E402
    APIError,
    SamplingOptions,
    check_lengths,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)


def test_completion_defaults_follow_openai():
    req = parse_completion_request({"model": "m", "prompt": "hi"})
    assert (req.prompt, req.stream, req.include_usage) == ("hi", False, False)
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop) == (16, 1.0, 1.0, -1, None, [])


def test_one_element_batches_and_token_ids():
    assert parse_completion_request({"model": "m", "prompt": ["hi"]}).prompt == "hi"
    assert parse_completion_request({"model": "m", "prompt": [[1, 2, 3]]}).prompt == [1, 2, 3]
    with pytest.raises(APIError, match="batches"):
        parse_completion_request({"model": "m", "prompt": ["a", "b"]})
    with pytest.raises(APIError):
        parse_completion_request({"model": "m", "prompt": [True, 2]})


def test_chat_aliases_and_content_parts():
    req = parse_chat_request(
        {
            "model": "m",
            "max_completion_tokens": 7,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
        }
    )
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert req.sampling.max_tokens == 7 and req.stream and req.include_usage
    assert (
        parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}]}).sampling.max_tokens is None
    )
    with pytest.raises(APIError) as e:
        parse_chat_request({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert e.value.param == "messages[0].content[0]"
    with pytest.raises(APIError) as e:
        parse_chat_request(
            {"model": "m", "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": "x"}]}
        )
    assert e.value.param == "stream_options"


def test_lengths_and_defaults():
    assert check_lengths(10, SamplingOptions(max_tokens=None), 1024, "messages") == 1014
    assert check_lengths(10, SamplingOptions(max_tokens=None), 1024, "messages", default_total=500) == 490
    assert check_lengths(10, SamplingOptions(max_tokens=1014), 1024, "prompt") == 1014
    with pytest.raises(APIError) as e:
        check_lengths(10, SamplingOptions(max_tokens=1015), 1024, "prompt")
    assert (e.value.param, e.value.code) == ("max_tokens", "context_length_exceeded")
    with pytest.raises(APIError) as e:
        check_lengths(1024, SamplingOptions(max_tokens=1), 1024, "messages")
    assert e.value.param == "messages"


def test_json_body_and_engine_messages():
    with pytest.raises(APIError, match="not valid UTF-8"):
        parse_json_body(b"\xff\xfe")
    with pytest.raises(APIError, match="not valid JSON"):
        parse_json_body(b'{"model": ')
    with pytest.raises(APIError, match="JSON object"):
        parse_json_body(b'"text"')
