"""`kvledger serve`: check the options, bind the port, load the model, start the engine thread and
serve the OpenAI API with uvicorn.

Exit status: 0 after a clean shutdown (SIGTERM or SIGINT: open requests get `--drain-timeout`
seconds to finish, the rest end with an explicit error event), 1 after an engine fault (open
requests are answered first, so a supervisor can restart the process), 2 for bad options or a
port that cannot be bound.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from typing import List, Optional

from kvledger.engine.cli import option_error
from kvledger.engine.engine_config import EngineConfig
from kvledger.engine.cli_parser import OneLineErrorParser
from kvledger.engine.options import EngineOptionError

log = logging.getLogger("kvledger.serve")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be between 0 and 65535, got {port}")
    return port


def _positive(kind: type):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--api-key", dest="api_key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 and /debug")
    p.add_argument("--served-model-name", dest="served_model_name", default=None,
                   help="the model id clients send (default: the model file's name)")
    p.add_argument("--max-waiting", dest="max_waiting", type=_positive(int), default=1024,
                   help="refuse new requests with 503 while this many wait for prefill")
    p.add_argument("--max-connections", dest="max_connections", type=_positive(int), default=256,
                   help="open connections beyond this get 503 (default 256)")
    p.add_argument("--timeout-header", dest="timeout_header", type=_positive(float), default=10.0,
                   help="seconds a client has to send a request's line and headers (default 10)")
    p.add_argument("--timeout-body", dest="timeout_body", type=_positive(float), default=20.0,
                   help="seconds a client has to send a request's body (default 20)")
    p.add_argument("--timeout-keep-alive", dest="timeout_keep_alive", type=_positive(int), default=5,
                   help="seconds an idle keep-alive connection stays open (default 5)")
    p.add_argument("--drain-timeout", dest="drain_timeout", type=_positive(float), default=30.0,
                   help="on SIGTERM, seconds open requests get to finish before they are stopped (default 30)")
    p.add_argument("--log-level", dest="log_level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"], help="server log level")
    EngineConfig.add_arguments(p)


def add_serve_parser(subparsers) -> None:
    """Register `serve` on the `kvledger` command's subparsers."""
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_serve_arguments(p)
    p.set_defaults(func=serve_command)


def _bind(host: str, port: int) -> socket.socket:
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


def serve_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = EngineConfig.from_args(args)
    except EngineOptionError as e:
        return option_error("kvledger serve", e)
    try:  # before the model loads: a port in use fails in a second, not after the load
        sock = _bind(args.host, args.port)
    except OSError as e:
        print(f"kvledger serve: --port: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    try:
        return _serve(args, config, sock)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, config: EngineConfig, sock: socket.socket) -> int:
    import uvicorn

    from kvledger.engine.runtime.llm import LLM
    from kvledger.engine.server.app import create_app, model_name_for
    from kvledger.engine.server.draining import DrainingServer
    from kvledger.engine.server.header_timeout import with_header_timeout
    from kvledger.engine.server.worker import EngineWorker

    try:
        llm = LLM(config=config)
    except EngineOptionError as e:  # the options that depend on the model's config
        return option_error("kvledger serve", e)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvledger serve: {e}", file=sys.stderr)
        return 2
    server: Optional[DrainingServer] = None

    def on_fault(message: str) -> None:
        log.critical("the engine failed (%s): answering open requests, then exiting with status 1", message)
        if server is not None:
            server.should_exit = True

    worker = EngineWorker(llm, max_waiting=args.max_waiting, on_fault=on_fault)
    name = args.served_model_name or model_name_for(args.model)
    app = create_app(worker, model_name=name, api_key=args.api_key, body_timeout=args.timeout_body)
    config = uvicorn.Config(app, http=with_header_timeout(args.timeout_header), log_level=args.log_level,
                            access_log=args.log_level in ("info", "debug"), limit_concurrency=args.max_connections,
                            timeout_keep_alive=args.timeout_keep_alive, timeout_graceful_shutdown=5)
    server = DrainingServer(config, worker, args.drain_timeout)
    verify = " with --verify (every cache operation shadowed in the reference model)" if args.verify else ""
    print(f"kvledger serve: {name} on http://{args.host}:{sock.getsockname()[1]}/v1{verify}", file=sys.stderr,
          flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        llm.close()
    if worker.fatal is not None:
        return 1
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = OneLineErrorParser(prog="python -m engine.server", description=__doc__)
    add_serve_arguments(parser)
    return serve_command(parser.parse_args(argv))
