"""The server's HTTP/1.1 protocol (`header_timeout.HeaderTimeoutH11Protocol`) on a real uvicorn,
in a child process, around a tiny app: a request head over the size limit gets a 431 the client
can read (no reset, no traceback in the server's log) whichever way it is split into reads, a head
at the limit is served, and a malformed request gets one 400."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Iterator, Tuple

import httpx
import pytest

from kvledger.engine.server.header_timeout import with_header_timeout
from kvledger.engine.server.launch import ServerProcess

LIMIT = 16384  # h11's default max_incomplete_event_size, which uvicorn keeps
SERVER = """
import argparse
import uvicorn
from kvledger.engine.server.header_timeout import with_header_timeout

async def app(scope, receive, send):
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})

p = argparse.ArgumentParser()
for flag in ("--host", "--port", "--loop"):
    p.add_argument(flag)
a = p.parse_args()
uvicorn.run(app, host=a.host, port=int(a.port), loop=a.loop, http=with_header_timeout(5.0), lifespan="off",
            log_level="info")
"""


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def server(request) -> Iterator[ServerProcess]:
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
    with ServerProcess(["--loop", request.param], entry=("-c", SERVER), startup_timeout=60) as srv:
        yield srv
        assert_clean(srv)


def head(size: int, method: bytes = b"GET") -> bytes:
    """A request line and headers of exactly `size` bytes, most of them one header's value."""
    start, end = method + b" / HTTP/1.1\r\nHost: x\r\nX-Big: ", b"\r\n\r\n"
    return start + b"a" * (size - len(start) - len(end)) + end


def exchange(port: int, *parts: bytes, pause: float = 0.0) -> bytes:
    """Send the parts (pausing between them, so that they arrive as separate reads), then read
    until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        for i, part in enumerate(parts):
            if i and pause:
                time.sleep(pause)
            s.sendall(part)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def split(reply: bytes) -> Tuple[bytes, bytes]:
    status, _, rest = reply.partition(b"\r\n")
    return status, rest.partition(b"\r\n\r\n")[2]


def assert_clean(server: ServerProcess) -> None:
    time.sleep(0.2)  # for what the server logs about the last connection
    log = server.log(tail=None)
    assert "Traceback" not in log and "LocalProtocolError" not in log, log


def test_a_one_mib_header_gets_a_431_the_client_reads(server):
    reply = exchange(server.port, head(1 << 20))
    status, body = split(reply)
    assert status == b"HTTP/1.1 431 Request Header Fields Too Large", reply[:300]
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and f"larger than {LIMIT} bytes" in error["message"]
    assert_clean(server)
    assert httpx.get(f"{server.url}/", timeout=10).status_code == 200  # the server carries on


def test_an_http_client_gets_the_431_not_a_reset(server):
    for _ in range(3):
        r = httpx.post(f"{server.url}/", headers={"X-Big": "a" * (1 << 20)}, content=b"{}", timeout=30)
        assert r.status_code == 431, r.text
    assert_clean(server)


@pytest.mark.parametrize("pause", [0.0, 0.2])
def test_a_head_at_the_limit_is_served_and_one_byte_more_is_not(server, pause):
    at, over = head(LIMIT), head(LIMIT + 1)
    # whole, or all but its last two bytes first (h11 alone checks only an incomplete head)
    assert split(exchange(server.port, at[:-2], at[-2:], pause=pause))[0] == b"HTTP/1.1 200 OK"
    assert split(exchange(server.port, over[:-2], over[-2:], pause=pause))[0].startswith(b"HTTP/1.1 431")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(head(LIMIT - 2000))
        assert s.recv(65536).startswith(b"HTTP/1.1 200")  # and the connection stays open
    assert_clean(server)


def test_an_oversized_head_after_a_keep_alive_request(server):
    first = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    reply = exchange(server.port, first, head(200_000), pause=0.2)
    assert reply.startswith(b"HTTP/1.1 200") and b"\r\n\r\nokHTTP/1.1 431 " in reply, reply[:400]
    assert_clean(server)


def test_an_oversized_head_with_a_body_behind_it(server):
    reply = exchange(server.port, head(100_000, b"POST")[:-2] + b"\r\nContent-Length: 500000\r\n\r\n", b"x" * 500_000)
    assert split(reply)[0].startswith(b"HTTP/1.1 431"), reply[:300]
    assert_clean(server)


def test_a_malformed_request_gets_one_400(server):
    reply = exchange(server.port, b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n" + b"x" * 300_000)
    status, body = split(reply)
    assert status == b"HTTP/1.1 400 Bad Request", reply[:300]
    assert json.loads(body)["error"]["message"].startswith("invalid HTTP request")
    assert reply.count(b"HTTP/1.1") == 1
    assert_clean(server)


def test_a_malformed_body_while_the_app_reads_it_gets_one_400(server):
    start = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
    reply = exchange(server.port, start, b"zz\r\n" + b"x" * 100_000, pause=0.2)
    assert split(reply)[0] == b"HTTP/1.1 400 Bad Request", reply[:300]
    assert reply.count(b"HTTP/1.1") == 1  # the app's own answer, after it saw the disconnect, goes nowhere
    assert_clean(server)


class _Transport(asyncio.Transport):
    """Records what the protocol writes; keeps delivering reads after close, as a transport may
    for data already read from the socket."""

    def __init__(self) -> None:
        super().__init__()
        self.written, self.closed, self.eof = b"", False, False

    def write(self, data) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5), "sockname": ("127.0.0.1", 80)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_reads_after_the_answer_are_dropped_without_a_second_answer():
    """uvicorn's own protocol answers every read after a bad head again, and h11 refuses the second
    answer with `LocalProtocolError ... state=MUST_CLOSE`; here there is one answer and no error."""
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    async def app(scope, receive, send):  # never reached
        raise AssertionError(scope)

    async def run() -> _Transport:
        config = Config(app, http=with_header_timeout(5.0), lifespan="off")
        config.load()
        proto = config.http_protocol_class(
            config=config, server_state=ServerState(), app_state={}, _loop=asyncio.get_running_loop()
        )
        transport = _Transport()
        proto.connection_made(transport)
        data = head(1 << 20)
        for i in range(0, len(data), 256 << 10):  # four full reads
            proto.data_received(data[i : i + (256 << 10)])
        proto.connection_lost(None)
        return transport

    transport = asyncio.run(run())
    assert transport.written.startswith(b"HTTP/1.1 431 ") and transport.written.count(b"HTTP/1.1") == 1
    assert transport.eof and transport.closed
