"""`kvledger serve`: load the model, start the engine thread, serve the OpenAI API with uvicorn."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from engine.cli import add_engine_options, engine_kwargs


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", dest="api_key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 and /debug")
    p.add_argument("--served-model-name", dest="served_model_name", default=None,
                   help="the model id clients send (default: the model file's name)")
    p.add_argument("--max-waiting", dest="max_waiting", type=int, default=1024,
                   help="refuse new requests with 503 while this many wait for prefill")
    p.add_argument("--log-level", dest="log_level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_engine_options(p)


def add_serve_parser(subparsers) -> None:
    """Register `serve` on the `kvledger` command's subparsers."""
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_serve_arguments(p)
    p.set_defaults(func=serve_command)


def serve_command(args: argparse.Namespace) -> int:
    import uvicorn

    from engine.llm import LLM
    from engine.server.app import create_app, model_name_for
    from engine.server.worker import EngineWorker

    try:
        llm = LLM(**engine_kwargs(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"kvledger serve: {e}", file=sys.stderr)
        return 2
    worker = EngineWorker(llm, max_waiting=args.max_waiting)
    name = args.served_model_name or model_name_for(args.model)
    app = create_app(worker, model_name=name, api_key=args.api_key)
    verify = " with --verify (every cache operation shadowed in the reference model)" if args.verify else ""
    print(f"kvledger serve: {name} on http://{args.host}:{args.port}/v1{verify}", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.log_level in ("info", "debug"), timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run()
    finally:
        llm.close()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.server", description=__doc__)
    add_serve_arguments(parser)
    return serve_command(parser.parse_args(argv))
