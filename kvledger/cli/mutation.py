"""`kvledger mutation` (`make mutation`): the mutation score of the cache logic with cosmic-ray;
`kvledger/checker/audit/mutation.py` runs it (and, as a script, its workers and its kill stages)."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def add_parser(sub: argparse._SubParsersAction) -> None:
    from kvledger.checker.audit.mutation import DEFAULT_CONFIG, WORK_DIR  # nothing heavy at the module's top

    p = sub.add_parser("mutation", help="mutation score of fast/, reference/ and the cache scheduler (cosmic-ray)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="the cosmic-ray config with its [kvledger-mutation] table")
    p.add_argument("--workers", type=int, default=None, help="parallel workers, each in its own copy (default: CPUs)")
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="SEL",
        help="mutate only PATH, PATH::FUNCTION, PATH:LINE or PATH:FIRST-LAST (repeatable)",
    )
    p.add_argument("--limit", type=int, default=None, help="at most this many mutants (the first, by position)")
    p.add_argument("--stages", default=None, help="comma-separated stages to run (default: the config's)")
    p.add_argument("--fuzz-cases", type=int, default=None, help="override the fuzz stage's number of cases")
    p.add_argument("--examples", type=int, default=None, help="override the Hypothesis stage's examples")
    p.add_argument("--pytest", default=None, metavar="FILES", help="comma-separated test files for the pytest stage")
    p.add_argument("--equivalents", default=None, metavar="FILE", help="override the equivalents file")
    p.add_argument("--timeout", type=float, default=None, help="seconds before a mutant's run counts as a hang")
    p.add_argument("--resume", action="store_true", help="continue the session in the work dir (run what is pending)")
    p.add_argument(
        "--rerun",
        default=None,
        metavar="OUTCOMES",
        help="with --resume: run again the mutants with these outcomes (comma-separated: survived, timeout)",
    )
    p.add_argument("--work-dir", default=None, metavar="DIR", help=f"session and copies (default: {WORK_DIR})")
    p.add_argument("--results", default=None, metavar="DIR", help="also write the report to DIR/README.md")
    p.add_argument(
        "--cluster",
        default=None,
        metavar="ADDRESS",
        help="run blocks of mutants as campaign tasks on this Ray cluster (auto, local, or an address); "
        "needs kvledger[cluster]",
    )
    p.add_argument("--block", type=int, default=20, help="with --cluster: mutants per task")
    p.set_defaults(func=mutation_command)


def _split(text: Optional[str]) -> Optional[List[str]]:
    return None if text is None else [x for x in text.split(",") if x]


def mutation_command(args: argparse.Namespace) -> int:
    from kvledger.checker.audit.mutation import run

    try:
        return run(
            args.config,
            args.workers,
            args.only,
            args.limit,
            _split(args.stages),
            args.fuzz_cases,
            args.examples,
            _split(args.pytest),
            args.equivalents,
            args.timeout,
            args.resume,
            _split(args.rerun) or (),
            args.work_dir,
            args.results,
            cluster=args.cluster,
            block=args.block,
        )
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"kvledger mutation: {e}", file=sys.stderr)
        return 2
