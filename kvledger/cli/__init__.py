"""kvledger: check and fuzz KV-cache managers, minimize failing traces, generate and serve text on
the verified engine, and benchmark it. `kvledger COMMAND --help` for each command."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, List, Tuple

# torch's OpenMP workers spin while idle; on 2 shared cores that costs an order of magnitude
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# commands that configure their log themselves (serve: uvicorn's levels, its own --log-level)
OWN_LOGGING = ("serve",)


def commands() -> Tuple[Tuple[str, Callable[[argparse._SubParsersAction], None]], ...]:
    """The subcommands in `kvledger --help`'s order, each with the function that registers it. Every
    module here imports only light modules at the top: building the parser never imports torch."""
    from kvledger.cli import bench, check, explore, fuzz, generate, mutation, replay, serve, subjects, zoo

    return (
        ("check", check.add_check),
        ("replay", replay.add_replay),
        ("generate", generate.add_parser),
        ("serve", serve.add_parser),
        ("bench", bench.add_parser),
        ("zoo", zoo.add_zoo),
        ("fuzz", fuzz.add_fuzz),
        ("explore", explore.add_parser),
        ("minimize", replay.add_minimize),
        ("subjects", subjects.add_subjects),
        ("show", subjects.add_show),
        ("coverage", subjects.add_coverage),
        ("mutation", mutation.add_parser),
    )


def build_parser() -> argparse.ArgumentParser:
    from kvledger import __version__
    from kvledger.cli.parser import OneLineErrorParser, add_logging_options

    parser = OneLineErrorParser(prog="kvledger", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvledger {__version__}")
    add_logging_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, add in commands():
        add(sub)
        if name not in OWN_LOGGING:
            add_logging_options(sub.choices[name])
    return parser


def main(argv: List[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command not in OWN_LOGGING:
        from kvledger.cli.parser import configure_logging, log_level

        configure_logging(log_level(args))
    try:
        return args.func(args)
    except ModuleNotFoundError as e:  # `make run` installs no extra: name the one this command needs
        from kvledger.cli.extras import missing_extra

        message = missing_extra(e, args.command)
        if message is None:
            raise
        print(f"kvledger: {message}", file=sys.stderr)
        return 2
