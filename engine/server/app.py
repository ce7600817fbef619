"""The OpenAI-compatible HTTP API on top of the engine thread.

Routes: /v1/completions, /v1/chat/completions (JSON or SSE streaming), /v1/models, /health,
/metrics (Prometheus text) and /debug/integrity (the last idle integrity check). With an API key,
/v1 and /debug need `Authorization: Bearer KEY`; /health and /metrics stay open for probes.

Hostile input gets a 4xx naming what was wrong: bodies must be `application/json` in UTF-8 and
arrive within `body_timeout` seconds; prompts obviously over the context are refused by size before
tokenizing, and tokenizing runs in a worker thread so one huge prompt cannot stall the event loop.
A 500, should one happen, says only "internal error" and a request id; the detail goes to the log.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvledger.engine.server import metrics, protocol
from kvledger.engine.server.generation import ClientGone, Generation
from kvledger.engine.server.protocol import APIError, ChatRequest, CompletionRequest, SamplingOptions
from kvledger.engine.server.worker import EngineWorker
from kvledger.fast import SamplingParams

log = logging.getLogger("kvledger.serve")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_BODY_BYTES = 4 << 20  # far above any prompt that fits a context; stops a client from filling memory
BODY_TIMEOUT_S = 20.0
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models")
CheckSize = Callable[[List[str], str], None]
# (rid, model, a text piece or None for the final and usage chunks, finish_reason, usage, created)
ChunkFn = Callable[[str, str, Optional[str], Optional[str], Optional[Dict[str, Any]], int], Dict[str, Any]]


def model_name_for(path: Optional[str]) -> str:
    if path is None:
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(os.path.normpath(path))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def create_app(
    worker: EngineWorker, *, model_name: str, api_key: Optional[str] = None, body_timeout: float = BODY_TIMEOUT_S
) -> FastAPI:
    """The app; it starts the worker's thread on startup and stops it on shutdown."""
    llm = worker.llm
    tokenizer = llm.tokenizer
    limits = worker.limits
    responses: Counter = Counter()
    exposition = metrics.ServerMetrics(worker, responses)  # this server's own registry

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if tokenizer is not None:  # the size check's bound, computed once (about half a second)
            await asyncio.to_thread(lambda: tokenizer.max_token_bytes)
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="kvledger", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_CountResponses, counts=responses)

    # -- errors: always the OpenAI shape -------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(protocol.error_body(message, code=str(exc.status_code)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        rid = protocol.new_id("err")
        log.error("internal error on %s %s (request id %s)", request.method, request.url.path, rid, exc_info=exc)
        body = protocol.error_body(f"internal error (request id {rid})", type="server_error")
        return JSONResponse(body, status_code=500)

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(
                "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                status=401,
                code="invalid_api_key",
            )

    # -- probes and figures --------------------------------------------------------------------
    @app.get("/health")
    async def health() -> JSONResponse:
        if not worker.alive:
            return JSONResponse({"status": "error", "fault": worker.fatal or _not_alive(worker)}, status_code=503)
        if worker.draining:  # load balancers stop sending; open requests still finish
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(exposition.render(), media_type=metrics.CONTENT_TYPE)

    v1 = APIRouter(dependencies=[Depends(authorize)])

    @v1.get("/debug/integrity")
    async def integrity() -> JSONResponse:
        return JSONResponse(metrics.integrity_json(worker.integrity, worker.stats, worker.fatal))

    @v1.get("/v1/models")
    async def models() -> Dict[str, Any]:
        return {"object": "list", "data": [_model_card(model_name, limits.max_seq_len)]}

    @v1.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Dict[str, Any]:
        _check_model(model_id, model_name)
        return _model_card(model_name, limits.max_seq_len)

    # -- generation ----------------------------------------------------------------------------
    def decode(ids: List[int]) -> str:
        return tokenizer.decode(ids) if tokenizer is not None else ""

    def sampling_params(s: SamplingOptions, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            ignore_eos=s.ignore_eos,
            max_tokens=max_tokens,
            seed=s.seed,
            stop_token_ids=tuple(s.stop_token_ids),
        )

    async def start(rid: str, ids: List[int], s: SamplingOptions, prompt_param: str) -> Generation:
        # a default max_tokens must also fit the KV pool, counted in whole pages
        fits_pool = limits.pool_tokens - limits.page_size + 1
        max_tokens = protocol.check_lengths(len(ids), s, limits.max_seq_len, prompt_param, fits_pool)
        gen = Generation(worker, rid, ids, sampling_params(s, max_tokens), decode, s.stop)
        await gen.start()
        return gen

    def check_size(texts: List[str], param: str) -> None:
        """Refuse text that cannot fit the context whatever it tokenizes to, before tokenizing it."""
        at_least = sum(tokenizer.min_tokens(t) for t in texts)
        if at_least >= limits.max_seq_len:
            raise APIError(
                f"{param} is at least {at_least} tokens; this model's context is {limits.max_seq_len} tokens",
                param=param,
                code="context_length_exceeded",
            )

    async def body_json(request: Request) -> Dict[str, Any]:
        protocol.check_content_type(request.headers.get("content-type"))
        return protocol.parse_json_body(await _read_body(request, body_timeout))

    async def generate(request: Request, endpoint: _Endpoint) -> Response:
        """The flow both generation routes share; `endpoint` holds what differs."""
        req = endpoint.parse(await body_json(request))
        _check_model(req.model, model_name)
        ids = await asyncio.to_thread(endpoint.encode, req, tokenizer, check_size)
        rid = protocol.new_id(endpoint.id_prefix)
        gen = await start(rid, ids, req.sampling, endpoint.prompt_param)
        if req.stream:
            return _EngineStream(gen, _events(endpoint, gen, rid, model_name, req.include_usage))
        text = await _collect(gen, request)
        return JSONResponse(endpoint.response(rid, model_name, text, gen.finish_reason, _usage(gen)))

    @v1.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, _COMPLETIONS)

    @v1.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, _CHAT)

    app.include_router(v1)
    return app


# -- helpers ----------------------------------------------------------------------------------
def _not_alive(worker: EngineWorker) -> str:
    if worker.stalled:
        return f"stall: a step has run past the step timeout ({worker.step_timeout:g} s)"
    return "the engine thread is not running"


def _model_card(name: str, max_seq_len: int) -> Dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvledger", "max_model_len": max_seq_len}


def _check_model(requested: str, served: str) -> None:
    if requested != served:
        raise APIError(
            f"the model '{requested}' does not exist; this server serves '{served}'",
            param="model",
            status=404,
            code="model_not_found",
        )


async def _read_body(request: Request, timeout: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(f"the request body is larger than {MAX_BODY_BYTES} bytes", status=413)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise APIError(f"the request body is larger than {MAX_BODY_BYTES} bytes", status=413)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(
            f"the request body did not arrive within {timeout:g} s ({size} bytes came)",
            status=408,
            code="request_timeout",
        ) from None
    except ClientDisconnect:  # the client gave up mid-upload: nobody is left to answer
        raise APIError("the client closed the request during the upload", status=499) from None
    return b"".join(chunks)


def _encode_prompt(req: CompletionRequest, tokenizer, check_size: CheckSize) -> List[int]:
    if isinstance(req.prompt, list):
        return req.prompt  # token ids: the engine checks them against the vocabulary
    if tokenizer is None:
        raise APIError("prompt: this model has no tokenizer; send the prompt as token ids", param="prompt")
    check_size([req.prompt], "prompt")
    return tokenizer.encode(req.prompt)


def _encode_chat(req: ChatRequest, tokenizer, check_size: CheckSize) -> List[int]:
    if tokenizer is None:
        raise APIError("messages: this model has no tokenizer, so no chat template", param="messages")
    check_size([m["content"] for m in req.messages], "messages")
    try:
        return tokenizer.apply_chat_template(req.messages)
    except Exception as e:  # the template itself may reject a conversation (e.g. role order)
        raise APIError(f"messages: the chat template rejected them: {e}", param="messages") from None


def _usage(gen: Generation) -> Dict[str, Any]:
    return protocol.usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)


async def _collect(gen: Generation, request: Request) -> str:
    try:
        return await gen.collect(request)
    except ClientGone:
        # nobody reads this answer; 499 is what proxies log for a client that closed the request
        raise APIError("the client closed the request", status=499) from None


async def _events(
    endpoint: _Endpoint, gen: Generation, rid: str, model: str, include_usage: bool
) -> AsyncIterator[bytes]:
    created = int(time.time())

    def event(
        piece: Optional[str], finish_reason: Optional[str] = None, usage_: Optional[Dict[str, Any]] = None
    ) -> bytes:
        return protocol.sse(endpoint.chunk(rid, model, piece, finish_reason, usage_, created))

    try:
        for chunk in endpoint.opening(rid, model, created):
            yield protocol.sse(chunk)
        async for piece in gen.pieces():
            yield event(piece)
        yield event(None, gen.finish_reason)
        if include_usage:
            yield event(None, usage_=_usage(gen))
    except APIError as e:  # the engine failed mid-stream: the status line is gone, so say it in the stream
        yield protocol.sse(e.body())
    yield protocol.sse("[DONE]")


# -- what the two generation routes do differently ---------------------------------------------


def _no_opening(rid: str, model: str, created: int) -> List[Dict[str, Any]]:
    return []


@dataclass(frozen=True)
class _Endpoint:
    """A generation route's own parts; `generate` in `create_app` does the rest (validation,
    submission to the engine, streaming or not, usage, error mapping)."""

    id_prefix: str  # of the response id
    prompt_param: str  # what length errors name
    parse: Callable[[Dict[str, Any]], Any]  # the JSON body -> CompletionRequest or ChatRequest
    encode: Callable[[Any, Any, CheckSize], List[int]]  # (request, tokenizer, check_size) -> prompt ids
    response: Callable[[str, str, str, Optional[str], Dict[str, Any]], Dict[str, Any]]  # non-streaming
    chunk: ChunkFn  # a stream chunk
    opening: Callable[[str, str, int], List[Dict[str, Any]]] = _no_opening  # chunks before the first piece


def _completion_chunk(
    rid: str,
    model: str,
    piece: Optional[str],
    finish_reason: Optional[str],
    usage_: Optional[Dict[str, Any]],
    created: int,
) -> Dict[str, Any]:
    return protocol.completion_chunk(rid, model, piece or "", finish_reason, usage_, created=created)


def _chat_chunk(
    rid: str,
    model: str,
    piece: Optional[str],
    finish_reason: Optional[str],
    usage_: Optional[Dict[str, Any]],
    created: int,
) -> Dict[str, Any]:
    delta = {} if piece is None else {"content": piece}
    return protocol.chat_chunk(rid, model, delta, finish_reason, usage_, created=created)


def _chat_opening(rid: str, model: str, created: int) -> List[Dict[str, Any]]:
    return [protocol.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None, created=created)]


_COMPLETIONS = _Endpoint(
    "cmpl", "prompt", protocol.parse_completion_request, _encode_prompt, protocol.completion_response, _completion_chunk
)
_CHAT = _Endpoint(
    "chatcmpl",
    "messages",
    protocol.parse_chat_request,
    _encode_chat,
    protocol.chat_response,
    _chat_chunk,
    _chat_opening,
)


class _EngineStream(StreamingResponse):
    """An SSE response that ends its engine request however the response ends, including a
    disconnect before the body generator ever ran."""

    def __init__(self, gen: Generation, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.abort()


class _CountResponses:
    """Pure ASGI middleware (BaseHTTPMiddleware would buffer streams): count /v1 responses by status."""

    def __init__(self, app, counts: Counter) -> None:
        self.app = app
        self.counts = counts

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1"):
            return await self.app(scope, receive, send)
        route = path if path in ROUTES else ("/v1/models" if path.startswith("/v1/models/") else "other")

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.counts[(route, message["status"])] += 1
            await send(message)

        await self.app(scope, receive, send=counting_send)
