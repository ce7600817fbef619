"""uvicorn's HTTP/1.1 protocol (h11) with a header read timeout and a clean answer to a bad head.

uvicorn times out only an idle keep-alive connection, and only until its first byte: a client that
opens a connection and sends its request line and headers a byte at a time (slowloris) holds the
connection forever. Here a timer runs from the moment the server waits for a request, on a new
connection and after each response, until that request's headers are complete; when it fires, the
client gets a 408 and the connection closes. Body read timeouts are the app's (`create_app`).

A request h11 cannot parse gets one answer with the status h11 suggests: 431 for a request line and
headers over the size limit (uvicorn's `h11_max_incomplete_event_size`, 16 KiB by default), 400
for the rest. uvicorn itself answers 400 to everything, then closes the socket with the rest of
the request still unread, so the kernel resets the connection and the client may never see the
answer; and should the connection deliver data again after that, uvicorn answers again, which
h11 refuses (`LocalProtocolError: can't handle event type Response when role=SERVER and
state=MUST_CLOSE`) with a traceback in the log. Here the answer goes
out once (JSON, in the OpenAI error shape), the write side is shut, and what the client still
sends is read and dropped until it closes (`LINGER_IDLE_S`, `LINGER_MAX_S`), so that the answer
arrives. The size limit holds however the head is split into reads (h11 alone enforces it only on
a head that is still incomplete).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, List, Optional, Union

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from kvledger.engine.server.protocol import error_body

REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
LINGER_IDLE_S = 2.0  # after an error answer, close once the client has sent nothing for this long
LINGER_MAX_S = 10.0  # and at the latest this long after the answer


class _Connection(h11.Connection):
    """h11's server connection that keeps the error its parser raised (uvicorn drops it, and with
    it the status hint) and holds a parsed request head to the size limit too."""

    def __init__(self, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes
        self.error: Optional[h11.RemoteProtocolError] = None

    def next_event(self) -> Union[h11.Event, type[h11.NEED_DATA], type[h11.PAUSED]]:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            self.error = self.error or e
            raise
        if isinstance(event, h11.Request) and _head_bytes(event) > self.max_head_bytes:
            # it came whole in one read, so h11 let it through; the connection ends with the answer
            self.error = h11.RemoteProtocolError("Request head too long", error_status_hint=431)
            raise self.error
        return event


def _head_bytes(request: h11.Request) -> int:
    """The request line and headers as parsed (the wire may have a little more whitespace)."""
    line = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers.raw_items()) + 2


def _error_answer(status: int, message: str) -> List[h11.Event]:
    """An answer from outside the app, in the OpenAI error shape."""
    body = json.dumps(error_body(message)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    return [
        h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status]),
        h11.Data(data=body),
        h11.EndOfMessage(),
    ]


class HeaderTimeoutH11Protocol(H11Protocol):
    header_timeout: float = 10.0  # seconds; set by `with_header_timeout`

    _header_timer: Optional[asyncio.TimerHandle] = None
    _linger_timer: Optional[asyncio.TimerHandle] = None
    _answered_error = False  # an error answer has been given: later reads are dropped
    _linger_start = _linger_last = 0.0  # loop times: the answer, the client's last read since

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limit = self.config.h11_max_incomplete_event_size
        self.conn = _Connection(DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if limit is None else limit)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._answered_error:  # lingering: read and drop until the client closes
            self._linger_last = self.loop.time()
            return
        super().data_received(data)

    def handle_events(self) -> None:
        if self._answered_error:
            return
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the request's headers are all in
            self._disarm()

    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this when h11 cannot parse the request (RemoteProtocolError)."""
        if self._answered_error:
            return
        self._answered_error = True
        self._disarm()
        self._unset_keepalive_if_required()
        error = self.conn.error if isinstance(self.conn, _Connection) else None
        status = error.error_status_hint if error is not None else 400
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:  # the app's answer, if any, goes nowhere
            cycle.disconnected = True
            cycle.message_event.set()
        state = self.conn.our_state
        if state is h11.IDLE or state is h11.SEND_RESPONSE:  # nothing of an answer is out yet
            message = _message(status, error, self.conn)
            peer = "%s:%d - " % self.client if self.client else ""
            self.logger.info("%s%s; answered %d", peer, message, status)
            for event in _error_answer(status, message):
                self.transport.write(self.conn.send(event) or b"")
        elif state is not h11.MUST_CLOSE:  # part of an answer is out: it cannot be mended
            self.transport.close()
            return
        self._linger()

    def _linger(self) -> None:
        """Close the write side after the answer, but keep reading (and dropping) what the client
        still sends: closing with unread data would reset the connection and lose the answer."""
        if self.transport.is_closing():
            return
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()
        self._linger_last = self._linger_start = self.loop.time()
        self._linger_timer = self.loop.call_later(LINGER_IDLE_S, self._linger_check)

    def _linger_check(self) -> None:
        now = self.loop.time()
        deadline = min(self._linger_last + LINGER_IDLE_S, self._linger_start + LINGER_MAX_S)
        if now >= deadline or self.transport.is_closing():
            self._linger_timer = None
            self.transport.close()
        else:
            self._linger_timer = self.loop.call_later(deadline - now, self._linger_check)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm()  # waiting for the next request on this keep-alive connection

    def shutdown(self) -> None:
        if self._answered_error:  # the answer is out; nothing is left to wait for
            self.transport.close()
            return
        super().shutdown()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE or self._answered_error:
            return
        if self.conn.our_state is h11.IDLE:  # nothing of a response is on the wire yet
            self.transport.write(REQUEST_TIMEOUT)
        self.transport.close()


def _message(status: int, error: Optional[h11.RemoteProtocolError], conn: h11.Connection) -> str:
    if status == 431 and isinstance(conn, _Connection):
        return f"the request line and headers are larger than {conn.max_head_bytes} bytes"
    detail = str(error)[:200] if error is not None else ""
    return f"invalid HTTP request: {detail}" if detail else "invalid HTTP request"


def with_header_timeout(seconds: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class to pass as uvicorn.Config(http=...)."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": seconds})
