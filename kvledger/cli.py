"""The `kvledger` command."""

from __future__ import annotations

import argparse
import os
import sys
from typing import List

# torch's OpenMP workers spin while idle; on 2 shared cores that costs an order of magnitude
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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


def _zoo(args: argparse.Namespace) -> int:
    from properties.zoo_run import main_zoo

    return main_zoo(args.bugs, args.fuzz_seconds, args.out, args.hypothesis_seconds)


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

    from engine.cli import add_generate_parser

    add_generate_parser(sub)

    p = sub.add_parser("bench", help="benchmarks that print numbers")
    p.add_argument("what", choices=["cache"])
    p.set_defaults(func=_bench)

    p = sub.add_parser("zoo", help="run the bug zoo: which property run catches each known bug")
    p.add_argument("--bugs", default=None, help="comma-separated bug names (default: all)")
    p.add_argument("--fuzz-seconds", type=float, default=10.0, help="fuzzer time per bug (0: skip)")
    p.add_argument("--hypothesis-seconds", type=float, default=45.0, help="time cap per bug for the CI profile")
    p.add_argument("--out", default=None, help="where to keep each bug's failing traces (default: a temp dir)")
    p.set_defaults(func=_zoo)
    return parser


def main(argv: List[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
