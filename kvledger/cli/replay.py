"""`kvledger replay` and `kvledger minimize`: a trace applied again, or shrunk keeping its failure."""

from __future__ import annotations

import argparse

from kvledger.cli.checker_options import add_isolation, add_subject, command_error, target_of


def add_replay(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="replay a trace on reference and fast in lockstep")
    p.add_argument("trace", help="the trace file (.jsonl)")
    p.add_argument("--device", default="cpu", help="where fast's tensors live: cpu or cuda")
    p.add_argument(
        "--bug",
        default=None,
        help="patch this bug-zoo bug into fast first (see kvledger zoo); with --subject, one of the subject's zoo",
    )
    add_subject(p)
    p.set_defaults(func=_replay)


def _named_subject(command: str, trace: str) -> str | int | None:
    """The subject the trace's header names (None: reference vs fast), or exit status 2 for a trace
    that cannot be read."""
    from kvledger.engine.ledger.trace import TraceError, read

    try:
        return read(trace)[0].subject
    except (OSError, TraceError) as e:
        return command_error(command, e)


def _replay(args: argparse.Namespace) -> int:
    named = _named_subject("replay", args.trace)
    if isinstance(named, int):
        return named
    target = target_of(args, "replay", named)
    if isinstance(target, int):
        return target
    from kvledger.checker.replay import replay_trace

    return replay_trace(args.trace, target)


def add_minimize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("minimize", help="shrink a failing trace, keeping its divergence kind")
    p.add_argument("trace", help="the failing trace (.jsonl)")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write the minimized trace")
    p.add_argument("--budget", type=float, default=60.0, help="time budget in seconds")
    p.add_argument(
        "--max-replays",
        type=int,
        default=None,
        help="also stop after this many candidate replays (the same result on any machine)",
    )
    p.add_argument("--bug", default=None, help="patch a bug-zoo bug into fast first")
    p.add_argument(
        "--subject",
        default=None,
        metavar="SPEC",
        help="minimize on this subject (default: the one the trace's header names, if any)",
    )
    add_isolation(p)
    p.set_defaults(func=_minimize)


def _minimize(args: argparse.Namespace) -> int:
    named = _named_subject("minimize", args.trace)
    if isinstance(named, int):
        return named
    target = target_of(args, "minimize", named)
    if isinstance(target, int):
        return target
    from kvledger.checker.minimize import main_minimize
    from kvledger.properties.subject import SubjectUnavailable

    try:
        return main_minimize(args.trace, args.output, args.budget, max_replays=args.max_replays, target=target)
    except SubjectUnavailable as e:
        return command_error("minimize", e)
