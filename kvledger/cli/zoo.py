"""`kvledger zoo`: which of the checker's runs catches each planted bug."""

from __future__ import annotations

import argparse

from kvledger.cli.checker_options import command_error


def add_zoo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("zoo", help="run the bug zoo: which property run catches each known bug")
    p.add_argument("--bugs", default=None, help="comma-separated bug names (default: all)")
    p.add_argument("--hypothesis-sequences", type=int, default=150, help="CI-profile sequences per bug (decides)")
    p.add_argument("--fuzz-cases", type=int, default=100, help="fuzz cases per bug (decides; 0: skip the fuzzer)")
    p.add_argument("--fuzz-seconds", type=float, default=300.0, help="safety cap per bug for the fuzzer (0: skip)")
    p.add_argument("--hypothesis-seconds", type=float, default=600.0, help="safety cap per bug for the CI profile")
    p.add_argument(
        "--out-dir", default=None, metavar="DIR", help="where to keep each bug's failing traces (default: a temp dir)"
    )
    p.add_argument(
        "--subject",
        default=None,
        metavar="SPEC",
        help="judge mode on this subject's own zoo (fast: kvledger's 39 bugs); --fuzz-seconds caps each bug",
    )
    p.add_argument("--max-cases", type=int, default=2000, help="with --subject: cases per bug at most")
    p.set_defaults(func=_zoo)


def _zoo(args: argparse.Namespace) -> int:
    if args.subject:  # the subject's own zoo: a target per bug
        from kvledger.checker.subject_zoo import print_subject_zoo, run_subject_zoo
        from kvledger.properties.subject import SubjectUnavailable
        from kvledger.subjects import SpecError

        bugs = args.bugs.split(",") if args.bugs else None
        try:
            rows = run_subject_zoo(args.subject, bugs, max_cases=args.max_cases, seconds=args.fuzz_seconds)
        except (SpecError, SubjectUnavailable) as e:
            return command_error("zoo", e)
        print_subject_zoo(args.subject, rows)
        return 0 if all(r.caught for r in rows) else 1
    from kvledger.checker.audit.zoo_run import main_zoo

    return main_zoo(
        args.bugs, args.fuzz_seconds, args.out_dir, args.hypothesis_seconds, args.hypothesis_sequences, args.fuzz_cases
    )
