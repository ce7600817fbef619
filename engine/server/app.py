"""The OpenAI-compatible HTTP API on top of the engine thread.

Routes: /v1/completions, /v1/chat/completions (JSON or SSE streaming), /v1/models, /health,
/metrics (Prometheus text) and /debug/integrity (the last idle integrity check). With an API key,
/v1 and /debug need `Authorization: Bearer KEY`; /health and /metrics stay open for probes.
"""

from __future__ import annotations

import hmac
import os
import time
from collections import Counter
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Dict, List, Optional, Union

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.server import metrics, protocol
from engine.server.generation import ClientGone, Generation
from engine.server.protocol import APIError, SamplingOptions
from engine.server.worker import EngineWorker
from fast import SamplingParams

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_BODY_BYTES = 4 << 20  # far above any prompt that fits a context; stops a client from filling memory
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models")


def model_name_for(path: Optional[str]) -> str:
    if path is None:
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(os.path.normpath(path))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def create_app(worker: EngineWorker, *, model_name: str, api_key: Optional[str] = None) -> FastAPI:
    """The app; it starts the worker's thread on startup and stops it on shutdown."""
    llm = worker.llm
    tokenizer = llm.tokenizer
    limits = worker.limits
    responses: Counter = Counter()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
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
        body = protocol.error_body(f"internal server error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(body, status_code=500)

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError("missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                           status=401, code="invalid_api_key")

    # -- probes and figures --------------------------------------------------------------------
    @app.get("/health")
    async def health() -> JSONResponse:
        if worker.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "error", "fault": worker.fatal or "the engine thread is not running"},
                            status_code=503)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        text = metrics.render(worker.stats, worker.integrity, worker.alive, responses)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

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
        return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, ignore_eos=s.ignore_eos,
                              max_tokens=max_tokens, seed=s.seed, stop_token_ids=tuple(s.stop_token_ids))

    async def start(ids: List[int], s: SamplingOptions, prompt_param: str) -> Generation:
        # a default max_tokens must also fit the KV pool, counted in whole pages
        fits_pool = limits.pool_tokens - limits.page_size + 1
        max_tokens = protocol.check_lengths(len(ids), s, limits.max_seq_len, prompt_param, fits_pool)
        gen = Generation(worker, ids, sampling_params(s, max_tokens), decode, s.stop)
        await gen.start()
        return gen

    @v1.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = protocol.parse_completion_request(protocol.parse_json_body(await _read_body(request)))
        _check_model(req.model, model_name)
        gen = await start(_encode_prompt(req.prompt, tokenizer), req.sampling, "prompt")
        rid = protocol.new_id("cmpl")
        if req.stream:
            return _EngineStream(gen, _completion_events(gen, rid, model_name, req.include_usage))
        text = await _collect(gen, request)
        return JSONResponse(protocol.completion_response(rid, model_name, text, gen.finish_reason, _usage(gen)))

    @v1.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = protocol.parse_chat_request(protocol.parse_json_body(await _read_body(request)))
        _check_model(req.model, model_name)
        gen = await start(_encode_chat(req.messages, tokenizer), req.sampling, "messages")
        rid = protocol.new_id("chatcmpl")
        if req.stream:
            return _EngineStream(gen, _chat_events(gen, rid, model_name, req.include_usage))
        text = await _collect(gen, request)
        return JSONResponse(protocol.chat_response(rid, model_name, text, gen.finish_reason, _usage(gen)))

    app.include_router(v1)
    return app


# -- helpers ----------------------------------------------------------------------------------
def _model_card(name: str, max_seq_len: int) -> Dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvledger", "max_model_len": max_seq_len}


def _check_model(requested: str, served: str) -> None:
    if requested != served:
        raise APIError(f"the model '{requested}' does not exist; this server serves '{served}'", param="model",
                       status=404, code="model_not_found")


async def _read_body(request: Request) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(f"the request body is larger than {MAX_BODY_BYTES} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


def _encode_prompt(prompt: Union[str, List[int]], tokenizer) -> List[int]:
    if isinstance(prompt, list):
        return prompt  # token ids: the engine checks them against the vocabulary
    if tokenizer is None:
        raise APIError("prompt: this model has no tokenizer; send the prompt as token ids", param="prompt")
    return tokenizer.encode(prompt)


def _encode_chat(messages: List[Dict[str, str]], tokenizer) -> List[int]:
    if tokenizer is None:
        raise APIError("messages: this model has no tokenizer, so no chat template", param="messages")
    try:
        return tokenizer.apply_chat_template(messages)
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


async def _completion_events(gen: Generation, rid: str, model: str, include_usage: bool) -> AsyncIterator[bytes]:
    created = int(time.time())
    try:
        async for piece in gen.pieces():
            yield protocol.sse(protocol.completion_chunk(rid, model, piece, None, created=created))
        yield protocol.sse(protocol.completion_chunk(rid, model, "", gen.finish_reason, created=created))
        if include_usage:
            yield protocol.sse(protocol.completion_chunk(rid, model, "", None, _usage(gen), created=created))
    except APIError as e:  # the engine failed mid-stream: the status line is gone, so say it in the stream
        yield protocol.sse(e.body())
    yield protocol.sse("[DONE]")


async def _chat_events(gen: Generation, rid: str, model: str, include_usage: bool) -> AsyncIterator[bytes]:
    created = int(time.time())
    try:
        yield protocol.sse(protocol.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None,
                                               created=created))
        async for piece in gen.pieces():
            yield protocol.sse(protocol.chat_chunk(rid, model, {"content": piece}, None, created=created))
        yield protocol.sse(protocol.chat_chunk(rid, model, {}, gen.finish_reason, created=created))
        if include_usage:
            yield protocol.sse(protocol.chat_chunk(rid, model, {}, None, _usage(gen), created=created))
    except APIError as e:
        yield protocol.sse(e.body())
    yield protocol.sse("[DONE]")


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
