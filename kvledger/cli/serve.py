"""`kvledger serve`: the OpenAI-compatible HTTP API on the engine. This module reads the options;
`engine/server/serve.py` binds the port, loads the model and serves.

Exit status: 0 after a clean shutdown (SIGTERM or SIGINT: open requests get `--drain-timeout`
seconds to finish, the rest end with an explicit error event), 1 after an engine fault (open
requests are answered first, so a supervisor can restart the process), 2 for bad options or a
port that cannot be bound.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields
from typing import Any, Callable, Dict, Tuple

from kvledger.cli.parser import option_error
from kvledger.engine.engine_config import EngineConfig
from kvledger.engine.server.serve import LOG_LEVELS, ServerOptions

PROG = "kvledger serve"
DEFAULTS = ServerOptions()


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be between 0 and 65535, got {port}")
    return port


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


# ServerOptions' flags: field -> (type, help); each flag is --FIELD-WITH-DASHES, its default the field's
SERVER_FLAGS: Dict[str, Tuple[Callable[[str], Any], str]] = {
    "host": (str, f"address to bind (default {DEFAULTS.host}: this machine only)"),
    "port": (_port, "port to listen on (0: any free port)"),
    "api_key": (str, "require 'Authorization: Bearer KEY' on /v1 and /debug"),
    "served_model_name": (str, "the model id clients send (default: the model file's name)"),
    "max_waiting": (_positive(int), "refuse new requests with 503 while this many wait for prefill"),
    "max_connections": (_positive(int), "open connections beyond this get 503"),
    "timeout_header": (_positive(float), "seconds a client has to send a request's line and headers"),
    "timeout_body": (_positive(float), "seconds a client has to send a request's body"),
    "timeout_keep_alive": (_positive(int), "seconds an idle keep-alive connection stays open"),
    "drain_timeout": (_positive(float), "on SIGTERM, seconds open requests get to finish before they are stopped"),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`serve` on the `kvledger` command's subparsers; it has its own --log-level (uvicorn's levels)."""
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    for name, (kind, text) in SERVER_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=getattr(DEFAULTS, name), help=text)
    p.add_argument(
        "--log-level", dest="log_level", default=DEFAULTS.log_level, choices=LOG_LEVELS, help="server log level"
    )
    EngineConfig.add_arguments(p)
    p.set_defaults(func=serve_command)


def serve_command(args: argparse.Namespace) -> int:
    import logging

    from kvledger.engine.options import EngineOptionError
    from kvledger.engine.server.serve import StartupError, serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = EngineConfig.from_args(args)
    except EngineOptionError as e:
        return option_error(PROG, e)
    options = ServerOptions(**{f.name: getattr(args, f.name) for f in fields(ServerOptions)})
    try:
        status = serve(config, options)
    except StartupError as e:
        if isinstance(e.__cause__, EngineOptionError):
            return option_error(PROG, e.__cause__)
        print(f"{PROG}: {'--port: ' if e.what == 'port' else ''}{e}", file=sys.stderr)
        return 2
    if status == 1:  # an engine fault, its requests answered: no interpreter teardown (seconds of
        # garbage collection on a busy host, which no exit timer can cut short), a supervisor restarts now
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return status
