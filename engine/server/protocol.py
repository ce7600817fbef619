"""OpenAI request parsing and validation, error bodies, and response objects.

Parsing is by hand rather than through pydantic models so that every rejection names the field
(`param`) the way OpenAI does, with one message per problem. Unknown fields are ignored, as the
official clients send fields this server has no use for.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union, overload

Prompt = Union[str, List[int]]
MAX_STOP_STRINGS = 8
MAX_JSON_DEPTH = 32  # far deeper than any request; json's recursion limit is about 1,000
MAX_INT_DIGITS = 4300  # Python's default limit on int(str)
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily


class APIError(Exception):
    """An error that becomes `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self,
        message: str,
        *,
        param: Optional[str] = None,
        status: int = 400,
        code: Optional[str] = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type

    def body(self) -> Dict[str, Any]:
        return error_body(self.message, param=self.param, code=self.code, type=self.type)


def error_body(
    message: str, *, param: Optional[str] = None, code: Optional[str] = None, type: str = "invalid_request_error"
) -> Dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- requests ---------------------------------------------------------------------------------
@dataclass
class SamplingOptions:
    max_tokens: Optional[int]  # None: as many as the context allows
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: Optional[int] = None
    ignore_eos: bool = False
    stop: List[str] = field(default_factory=list)
    stop_token_ids: List[int] = field(default_factory=list)


@dataclass
class CompletionRequest:
    model: str
    prompt: Prompt
    sampling: SamplingOptions
    stream: bool = False
    include_usage: bool = False


@dataclass
class ChatRequest:
    model: str
    messages: List[Dict[str, str]]
    sampling: SamplingOptions
    stream: bool = False
    include_usage: bool = False


def check_content_type(value: Optional[str]) -> None:
    """Bodies are JSON in UTF-8 (RFC 8259): anything else is a 415."""
    media, _, params = (value or "").partition(";")
    charset = next(
        (
            v.strip().strip('"').lower()
            for k, _, v in (p.partition("=") for p in params.split(";"))
            if k.strip().lower() == "charset"
        ),
        "utf-8",
    )
    if media.strip().lower() != "application/json" or charset not in ("utf-8", "utf8"):
        shown = (value or "none")[:100]
        raise APIError(
            f"Content-Type must be application/json (UTF-8), got {shown!r}",
            param="Content-Type",
            status=415,
            code="unsupported_media_type",
        )


class _Unacceptable:
    """A literal json accepts but a request may not hold; left in the tree so that the tree
    check can name its field."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _parse_int(literal: str) -> Any:
    digits = len(literal.lstrip("-"))
    if digits > MAX_INT_DIGITS:  # int() would raise ValueError past sys.get_int_max_str_digits()
        return _Unacceptable(f"is an integer literal of {digits} digits (at most {MAX_INT_DIGITS})")
    return int(literal)


def _parse_constant(name: str) -> Any:
    return _Unacceptable(f"is {name}, which is not a JSON number")


def parse_json_body(raw: bytes) -> Dict[str, Any]:
    try:
        # encoded surrogates (ED A0 80) pass here so that the tree check below names their field
        text = raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as e:
        raise APIError(f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text, parse_int=_parse_int, parse_constant=_parse_constant)
    except json.JSONDecodeError as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    _check_json_tree(body)
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {_kind(body)}")
    return body


def _check_json_tree(body: Any) -> None:
    """Every string is valid Unicode (no lone surrogate from a \\ud800 escape) and nesting is
    bounded; the error names the field, e.g. messages[0].content. Iterative: no recursion to exhaust."""
    stack: List[tuple[str, Any, int]] = [("", body, 0)]
    while stack:
        path, value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            field = re.split(r"[.\[]", path, maxsplit=1)[0]
            raise APIError(
                f"{field} is nested too deeply (the request body may have at most {MAX_JSON_DEPTH} levels)", param=field
            )
        if isinstance(value, _Unacceptable):
            raise APIError(f"{path or 'the request body'} {value.reason}", param=path or None)
        if isinstance(value, str):
            _require_unicode(value, path)
        elif isinstance(value, dict):
            for k, v in value.items():
                child = f"{path}.{k}" if path else k
                _require_unicode(k, f"{path}.<key>" if path else "<key>")
                stack.append((child, v, depth + 1))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v, depth + 1) for i, v in enumerate(value))


def _require_unicode(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        shown = path.encode("utf-8", "backslashreplace").decode()  # the path may hold the surrogate itself
        raise APIError(
            f"{shown} holds a lone surrogate (U+{ord(text[e.start]):04X} at character {e.start}), "
            "which is not valid Unicode",
            param=shown,
        ) from None


def parse_completion_request(body: Dict[str, Any]) -> CompletionRequest:
    model = _required_str(body, "model")
    if "prompt" not in body or body["prompt"] is None:
        raise APIError("prompt is required", param="prompt")
    prompt = _prompt(body["prompt"])
    for name, default in (("echo", False), ("logprobs", None), ("suffix", None)):
        if body.get(name) not in (default, None):
            raise APIError(f"{name} is not supported by this server", param=name)
    best_of = body.get("best_of")
    if best_of not in (None, 1):
        raise APIError("best_of must be 1 (only one completion per request is supported)", param="best_of")
    sampling = _sampling(body, max_tokens_default=16)
    stream, include_usage = _stream(body)
    return CompletionRequest(model, prompt, sampling, stream, include_usage)


def parse_chat_request(body: Dict[str, Any]) -> ChatRequest:
    model = _required_str(body, "model")
    messages = _messages(body.get("messages"))
    for name in ("logprobs", "tools", "functions", "response_format"):
        if body.get(name) not in (None, False, [], {"type": "text"}):
            raise APIError(f"{name} is not supported by this server", param=name)
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
        max_param = "max_completion_tokens"
    else:
        max_param = "max_tokens"
    sampling = _sampling(body, max_tokens_default=None, max_tokens_param=max_param)
    stream, include_usage = _stream(body)
    return ChatRequest(model, messages, sampling, stream, include_usage)


def check_lengths(
    prompt_len: int, sampling: SamplingOptions, max_seq_len: int, prompt_param: str, default_total: Optional[int] = None
) -> int:
    """Check the prompt and max_tokens against the context; return the max_tokens to use. Without
    max_tokens, prompt plus completion may fill the context, or `default_total` tokens if fewer."""
    if prompt_len == 0:
        raise APIError(f"{prompt_param} is empty: it must hold at least one token", param=prompt_param)
    if prompt_len >= max_seq_len:
        raise APIError(
            f"{prompt_param} is {prompt_len} tokens; this model's context is {max_seq_len} tokens, "
            f"so a prompt may have at most {max_seq_len - 1}",
            param=prompt_param,
            code="context_length_exceeded",
        )
    room = max_seq_len - prompt_len
    if sampling.max_tokens is None:
        return max(1, min(room, (default_total or max_seq_len) - prompt_len))
    if sampling.max_tokens > room:
        raise APIError(
            f"max_tokens is {sampling.max_tokens}, but the {prompt_len}-token {prompt_param} leaves room "
            f"for at most {room} in this model's {max_seq_len}-token context",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return sampling.max_tokens


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def _required_str(body: Dict[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None:
        raise APIError(f"{name} is required", param=name)
    if not isinstance(value, str):
        raise APIError(f"{name} must be a string, got {_kind(value)}", param=name)
    return value


def _prompt(value: Any) -> Prompt:
    # OpenAI also takes a batch (a list of prompts); one prompt per request is supported, which
    # a one-element batch still is
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise APIError("prompt is empty: it must hold at least one token", param="prompt")
        return value
    if isinstance(value, list):
        if not value:
            raise APIError("prompt is empty: it must hold at least one token", param="prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return list(value)
        if all(isinstance(t, (str, list)) for t in value):
            raise APIError(
                "prompt: batches of several prompts are not supported; send one request per prompt", param="prompt"
            )
        raise APIError("prompt must be a string or an array of token ids (integers)", param="prompt")
    raise APIError(f"prompt must be a string or an array of token ids, got {_kind(value)}", param="prompt")


def _messages(value: Any) -> List[Dict[str, str]]:
    if value is None:
        raise APIError("messages is required", param="messages")
    if not isinstance(value, list):
        raise APIError(f"messages must be an array, got {_kind(value)}", param="messages")
    if not value:
        raise APIError("messages is empty: send at least one message", param="messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(f"{where} must be an object, got {_kind(m)}", param=where)
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise APIError(
                f"{where}.role must be one of system, developer, user, assistant; got {role!r}", param=f"{where}.role"
            )
        out.append(
            {
                "role": "system" if role == "developer" else role,
                "content": _content(m.get("content"), f"{where}.content"),
            }
        )
    return out


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: only text parts can be served by a text model
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    f'{where}[{j}] must be a text part ({{"type": "text", "text": ...}})', param=f"{where}[{j}]"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise APIError(f"{where} must be a string or an array of text parts, got {_kind(value)}", param=where)


@overload
def _number(body: Dict[str, Any], name: str, default: float) -> float: ...
@overload
def _number(body: Dict[str, Any], name: str, default: Optional[float]) -> Optional[float]: ...
def _number(body: Dict[str, Any], name: str, default: Optional[float]) -> Optional[float]:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(f"{name} must be a number, got {_kind(value)}", param=name)
    try:
        return float(value)
    except OverflowError:  # an integer literal past float's range (309 digits or more)
        raise APIError(f"{name} is out of range: {_shown(value)}", param=name) from None


def _shown(value: Any) -> str:
    """A value for an error message: a huge integer is described, not repeated."""
    if isinstance(value, int) and abs(value) >= 10**20:
        return f"an integer of {len(str(abs(value)))} digits"
    return repr(value)


@overload
def _integer(body: Dict[str, Any], name: str, default: int) -> int: ...
@overload
def _integer(body: Dict[str, Any], name: str, default: Optional[int]) -> Optional[int]: ...
def _integer(body: Dict[str, Any], name: str, default: Optional[int]) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(f"{name} must be an integer, got {_kind(value)}", param=name)
    if not -(2**63) <= value < 2**64:  # beyond any count or seed: refuse before it reaches a message
        raise APIError(f"{name} is out of range (it must fit in 64 bits): {_shown(value)}", param=name)
    return value


def _sampling(
    body: Dict[str, Any], *, max_tokens_default: Optional[int], max_tokens_param: str = "max_tokens"
) -> SamplingOptions:
    n = _integer(body, "n", 1)
    if n != 1:
        raise APIError(f"n must be 1 (only one choice per request is supported), got {n}", param="n")
    max_tokens = _integer(body, "max_tokens", max_tokens_default)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(f"{max_tokens_param} must be at least 1, got {max_tokens}", param=max_tokens_param)
    temperature = _number(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise APIError(f"temperature must be between 0 and 2, got {temperature:g}", param="temperature")
    if temperature < GREEDY_BELOW:
        temperature = 0.0  # logits / 1e-300 overflow to inf and NaN probabilities; this close to 0 is greedy
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise APIError(f"top_p must be greater than 0 and at most 1, got {top_p:g}", param="top_p")
    top_k = _integer(body, "top_k", -1)
    if top_k == 0:  # 0 means "off" to several servers; this engine spells it -1
        top_k = -1
    if top_k < -1:
        raise APIError(f"top_k must be -1 (off) or at least 1, got {top_k}", param="top_k")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0) != 0.0:
            raise APIError(f"{name} is not supported by this server (only 0)", param=name)
    if body.get("logit_bias"):
        raise APIError("logit_bias is not supported by this server", param="logit_bias")
    seed = _integer(body, "seed", None)
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise APIError(f"seed must fit in 64 bits, got {seed}", param="seed")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise APIError(f"ignore_eos must be a boolean, got {_kind(ignore_eos)}", param="ignore_eos")
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        ignore_eos=ignore_eos,
        stop=_stop(body.get("stop")),
        stop_token_ids=_token_ids(body.get("stop_token_ids"), "stop_token_ids"),
    )


def _stop(value: Any) -> List[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError("stop must be a string or an array of strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise APIError("stop strings must not be empty", param="stop")
    return list(stops)


def _token_ids(value: Any, name: str) -> List[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise APIError(f"{name} must be an array of integers", param=name)
    if any(not 0 <= t < 2**63 for t in value):
        raise APIError(f"{name} must hold token ids (integers from 0)", param=name)
    return list(value)


def _stream(body: Dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise APIError(f"stream must be a boolean, got {_kind(stream)}", param="stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise APIError(f"stream_options must be an object, got {_kind(options)}", param="stream_options")
    if not stream:
        raise APIError("stream_options is only allowed with stream: true", param="stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise APIError("stream_options.include_usage must be a boolean", param="stream_options.include_usage")
    return stream, include


# -- responses --------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_response(
    rid: str, model: str, text: str, finish_reason: Optional[str], usage_: Dict[str, Any]
) -> Dict[str, Any]:
    return _response(rid, "text_completion", model, {"text": text}, finish_reason, usage_)


def completion_chunk(
    rid: str,
    model: str,
    text: str,
    finish_reason: Optional[str],
    usage_: Optional[Dict[str, Any]] = None,
    created: Optional[int] = None,
) -> Dict[str, Any]:
    return _chunk(rid, "text_completion", model, {"text": text}, finish_reason, usage_, created)


def chat_response(
    rid: str, model: str, text: str, finish_reason: Optional[str], usage_: Dict[str, Any]
) -> Dict[str, Any]:
    message = {"message": {"role": "assistant", "content": text}}
    return _response(rid, "chat.completion", model, message, finish_reason, usage_)


def chat_chunk(
    rid: str,
    model: str,
    delta: Dict[str, Any],
    finish_reason: Optional[str],
    usage_: Optional[Dict[str, Any]] = None,
    created: Optional[int] = None,
) -> Dict[str, Any]:
    return _chunk(rid, "chat.completion.chunk", model, {"delta": delta}, finish_reason, usage_, created)


def _choice(content: Dict[str, Any], finish_reason: Optional[str]) -> Dict[str, Any]:
    """The one choice: `content` is its text, message or delta."""
    return {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}


def _response(
    rid: str, object_: str, model: str, content: Dict[str, Any], finish_reason: Optional[str], usage_: Dict[str, Any]
) -> Dict[str, Any]:
    return {
        "id": rid,
        "object": object_,
        "created": int(time.time()),
        "model": model,
        "choices": [_choice(content, finish_reason)],
        "usage": usage_,
    }


def _chunk(
    rid: str,
    object_: str,
    model: str,
    content: Dict[str, Any],
    finish_reason: Optional[str],
    usage_: Optional[Dict[str, Any]],
    created: Optional[int],
) -> Dict[str, Any]:
    """A stream chunk; the usage chunk (`usage_` given) has no choices."""
    chunk = {
        "id": rid,
        "object": object_,
        "created": created or int(time.time()),
        "model": model,
        "choices": [] if usage_ is not None else [_choice(content, finish_reason)],
    }
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def sse(data: Union[Dict[str, Any], str]) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
