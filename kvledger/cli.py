"""The `kvledger` command."""

from __future__ import annotations

import argparse
import os
import sys
from typing import List


def _check(args: argparse.Namespace) -> int:
    os.environ["HYPOTHESIS_PROFILE"] = args.profile
    from properties.check import run_check

    return run_check(args.profile, args.examples)


def _replay(args: argparse.Namespace) -> int:
    from properties.replay import replay_file

    return replay_file(args.trace, device=args.device)


def _bench(args: argparse.Namespace) -> int:
    if args.what == "cache":
        from properties.bench_cache import main

        main()
        return 0
    print(f"kvledger bench: unknown benchmark {args.what!r} (available: cache)", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvledger", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", help="run the lockstep Hypothesis property run (reference vs fast)")
    p.add_argument("--profile", default="ci", choices=["ci", "deep", "dev"])
    p.add_argument("--examples", type=int, default=None, help="override the profile's number of examples")
    p.set_defaults(func=_check)

    p = sub.add_parser("replay", help="replay a trace on reference and fast in lockstep")
    p.add_argument("trace")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=_replay)

    p = sub.add_parser("bench", help="benchmarks that print numbers")
    p.add_argument("what", choices=["cache"])
    p.set_defaults(func=_bench)
    return parser


def main(argv: List[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
