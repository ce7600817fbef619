"""Serve the OpenAI API on the engine: bind the port, load the model, start the engine thread and
run uvicorn (`kvledger serve` parses the options and calls `serve`).

`serve` returns 0 after a clean shutdown (SIGTERM or SIGINT: open requests get `drain_timeout`
seconds to finish, the rest end with an explicit error event) and 1 after an engine fault (open
requests are answered first, so a supervisor can restart the process). A port that cannot be
bound or a model that cannot load raises StartupError before anything is served.
"""

from __future__ import annotations

import logging
import socket
import sys
from dataclasses import dataclass
from typing import Optional

from kvledger.engine.engine_config import EngineConfig

log = logging.getLogger("kvledger.serve")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class ServerOptions:
    """The HTTP side of a server; the engine's options are its EngineConfig."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port
    api_key: Optional[str] = None  # required as 'Authorization: Bearer KEY' on /v1 and /debug
    served_model_name: Optional[str] = None  # default: the model file's name
    max_waiting: int = 1024  # requests waiting for prefill before new ones get 503
    max_connections: int = 256
    timeout_header: float = 10.0  # seconds to send a request's line and headers
    timeout_body: float = 20.0  # seconds to send a request's body
    timeout_keep_alive: int = 5
    drain_timeout: float = 30.0  # on SIGTERM, seconds open requests get to finish
    log_level: str = "warning"  # uvicorn's, and the access log at info and debug


class StartupError(Exception):
    """The server did not start: `what` is "port" (it cannot be bound) or "model" (it cannot load;
    the cause is chained, an EngineOptionError for an option that depends on the model)."""

    def __init__(self, what: str, message: str) -> None:
        super().__init__(message)
        self.what = what


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(config: EngineConfig, options: ServerOptions) -> int:
    """Serve until shut down; the exit status (see the module's docstring)."""
    try:  # before the model loads: a port in use fails in a second, not after the load
        sock = bind(options.host, options.port)
    except OSError as e:
        where = f"{options.host}:{options.port}"
        raise StartupError("port", f"cannot listen on {where}: {e.strerror or e}") from e
    try:
        return _serve(config, options, sock)
    finally:
        sock.close()


def _serve(config: EngineConfig, options: ServerOptions, sock: socket.socket) -> int:
    import uvicorn

    from kvledger.engine.runtime.llm import LLM
    from kvledger.engine.server.app import create_app, model_name_for
    from kvledger.engine.server.draining import DrainingServer
    from kvledger.engine.server.header_timeout import with_header_timeout
    from kvledger.engine.server.worker import EngineWorker

    try:
        llm = LLM(engine_config=config)
    except (ValueError, FileNotFoundError) as e:  # EngineOptionError too: the options that need the model
        raise StartupError("model", str(e)) from e
    server: Optional[DrainingServer] = None

    def on_fault(message: str) -> None:
        log.critical("the engine failed (%s): answering open requests, then exiting with status 1", message)
        if server is not None:
            server.should_exit = True

    # after an engine fault the process ends within 4 s even if shutting down hangs (a stalled step)
    worker = EngineWorker(llm, max_waiting=options.max_waiting, on_fault=on_fault, exit_deadline=4.0)
    name = options.served_model_name or model_name_for(config.model)
    app = create_app(worker, model_name=name, api_key=options.api_key, body_timeout=options.timeout_body)
    level = options.log_level
    http = uvicorn.Config(
        app,
        http=with_header_timeout(options.timeout_header),
        log_level=level,
        access_log=level in ("info", "debug"),
        limit_concurrency=options.max_connections,
        timeout_keep_alive=options.timeout_keep_alive,
        timeout_graceful_shutdown=5,
    )
    server = DrainingServer(http, worker, options.drain_timeout)
    verify = " with --verify (every cache operation shadowed in the reference model)" if config.verify else ""
    print(
        f"kvledger serve: {name} on http://{options.host}:{sock.getsockname()[1]}/v1{verify}",
        file=sys.stderr,
        flush=True,
    )
    try:
        server.run(sockets=[sock])
    finally:
        llm.close()
    if worker.fatal is not None:
        return 1
    return 0
