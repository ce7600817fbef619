"""`kvledger zoo`: which of the checker's runs catches each planted bug of the target's zoo."""

from __future__ import annotations

import argparse

from kvledger.cli.checker_options import target_of


def add_zoo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("zoo", help="run the bug zoo: which property run catches each known bug")
    p.add_argument("--bugs", default=None, help="comma-separated bug names (default: all)")
    p.add_argument("--hypothesis-sequences", type=int, default=150, help="CI-profile sequences per bug (decides)")
    p.add_argument(
        "--fuzz-cases",
        "--max-cases",
        dest="fuzz_cases",
        type=int,
        default=None,
        help="fuzz cases per bug (decides; default 100, 2000 for a subject; 0: skip the fuzzer)",
    )
    p.add_argument("--fuzz-seconds", type=float, default=300.0, help="safety cap per bug for the fuzzer (0: skip)")
    p.add_argument("--hypothesis-seconds", type=float, default=600.0, help="safety cap per bug for the CI profile")
    p.add_argument(
        "--out-dir", default=None, metavar="DIR", help="where to keep each bug's failing traces (default: a temp dir)"
    )
    p.add_argument(
        "--subject",
        default=None,
        metavar="SPEC",
        help="judge mode on this subject's own zoo (fast: kvledger's 40 bugs); --fuzz-seconds caps each bug",
    )
    p.set_defaults(func=_zoo, bug=None)


def _zoo(args: argparse.Namespace) -> int:
    target = target_of(args, "zoo")
    if isinstance(target, int):
        return target
    from kvledger.checker.audit.zoo_run import main_zoo
    from kvledger.cli.checker_options import command_error
    from kvledger.properties.subject import SubjectUnavailable

    try:
        return main_zoo(
            target,
            args.bugs,
            args.fuzz_seconds,
            args.out_dir,
            args.hypothesis_seconds,
            args.hypothesis_sequences,
            args.fuzz_cases,
        )
    except (SubjectUnavailable, ValueError) as e:
        return command_error("zoo", e)
