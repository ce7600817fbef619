"""One request's life on the HTTP side: submit to the engine thread, turn tokens into text, and
abort in the engine whenever the request ends early (client gone, stop string, error)."""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable, List, Optional, Sequence

from starlette.requests import Request

from kvledger.engine.server.detok import TextStream
from kvledger.engine.server.protocol import APIError
from kvledger.engine.server.worker import Accepted, EngineWorker, Event, Failed, Token
from kvledger.fast import SamplingParams

log = logging.getLogger("kvledger.serve")


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


class Generation:
    def __init__(
        self,
        worker: EngineWorker,
        rid: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        decode: Callable[[List[int]], str],
        stop: Sequence[str] = (),
    ) -> None:
        self.rid = rid  # the response id, also named in error messages and the log
        self._worker = worker
        self._ids = list(token_ids)
        self._params = params
        self._decode = decode
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self.text = TextStream(decode, stop)
        self.uid: Optional[int] = None
        self.open = False  # submitted and not yet ended in the engine
        self.finish_reason: Optional[str] = None
        self.cached_tokens = 0

    @property
    def prompt_tokens(self) -> int:
        return len(self._ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.text.token_ids)

    def _sink(self, event: Event) -> None:  # called on the engine thread
        self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    async def start(self) -> None:
        """Submit and wait for the engine to accept; raise APIError if it refuses."""
        self.uid = self._worker.submit(self._ids, self._params, self._sink)
        self.open = True
        try:
            event = await self._events.get()
        except BaseException:
            self.abort()
            raise
        if isinstance(event, Failed):
            self.open = False
            raise _as_api_error(event, self.rid)
        assert isinstance(event, Accepted)

    def abort(self, reason: str = "abort") -> None:
        if self.open and self.uid is not None:
            self.open = False
            self._worker.abort(self.uid, reason)

    async def pieces(self) -> AsyncIterator[str]:
        """Text pieces as they become safe to show, until the request finishes. However the
        caller stops (exception, cancellation, closing the iterator), the engine request ends."""
        try:
            while self.open:
                event = await self._events.get()
                if isinstance(event, Failed):
                    self.open = False
                    raise _as_api_error(event, self.rid)
                assert isinstance(event, Token)
                self.cached_tokens = event.cached_tokens
                self.text.add(event.token)
                if event.finished:
                    self.open = False
                    self.finish_reason = event.finish_reason
                elif self.text.stopped:
                    self.finish_reason = "stop"
                    self.abort("stop")
                piece = self.text.flush(final=not self.open)
                if piece:
                    yield piece
        finally:
            self.abort()

    def final_text(self) -> str:
        # a whole decode is the reference text (LLM.generate's); a stop string truncates it
        return self.text.text if self.text.stopped else self._decode(self.text.token_ids)

    async def collect(self, request: Request) -> str:
        """Run to the end (non-streaming); abort and raise ClientGone if the client disconnects."""

        async def consume() -> None:
            async for _ in self.pieces():
                pass

        work = asyncio.ensure_future(consume())
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                raise ClientGone()
        work.result()
        return self.final_text()


async def _disconnected(request: Request) -> None:
    # the body has been read, so the next ASGI message is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _as_api_error(event: Failed, rid: str) -> APIError:
    if event.status == 500:  # a fault: the detail goes to the log, not to the client
        log.error("request %s failed: %s", rid, event.message)
        return APIError(f"internal error (request id {rid})", status=500, type="server_error")
    if event.status >= 500:
        return APIError(event.message, status=event.status, type="server_error", code=event.code or "overloaded")
    return APIError(event.message, param=event.param, status=event.status, code=event.code)
