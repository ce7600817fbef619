"""`kvledger check`: the Hypothesis property run, here or as a campaign."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvledger.cli.checker_options import (
    add_campaign,
    add_speculate,
    add_subject,
    campaign_setup,
    command_error,
    is_subject,
    shifted,
    target_of,
)


def add_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check",
        help="run the lockstep Hypothesis property run (reference vs fast), or judge "
        "mode on another cache manager (--subject)",
    )
    p.add_argument(
        "--profile",
        default="ci",
        choices=["ci", "deep", "dev"],
        help="Hypothesis profile, in valid sequences: lockstep ci 1500 of up to 60 operations, deep 5000 of "
        "up to 120, dev 40 of up to 30; with --subject ci 300 of up to 40, deep 3000 of up to 80, dev 30 of "
        "up to 30. A run reports every sequence it started, the discarded ones too (no rule enabled, or too "
        "large a draw): a few more in lockstep, about twice as many with --subject",
    )
    p.add_argument(
        "--examples", type=int, default=None, help="override the profile's number of valid sequences (examples)"
    )
    add_subject(p)
    add_speculate(p)
    p.add_argument(
        "--bug", default=None, help="plant this zoo bug first: fast's (bug-zoo.md), or with --subject the subject's"
    )
    p.add_argument("--out-dir", default=".kvledger/failures", metavar="DIR", help="where a failing trace goes")
    p.add_argument(
        "--seed", type=int, default=0, help="with --tasks: task i runs under a Hypothesis seed from (seed, i)"
    )
    p.add_argument(
        "--workers", type=int, default=1, help="with --tasks: worker processes here (or CPUs of --cluster local)"
    )
    add_campaign(p, "each a Hypothesis run of --examples sequences with its own seed")
    p.set_defaults(func=_check)


def _check(args: argparse.Namespace) -> int:
    os.environ["HYPOTHESIS_PROFILE"] = args.profile
    target = target_of(args, "check")
    if isinstance(target, int):
        return target
    if args.tasks is not None:
        return _check_campaign(args, target)
    from kvledger.checker.check import run_check
    from kvledger.properties.subject import SubjectUnavailable

    try:
        return run_check(target, args.profile, args.examples, args.out_dir)
    except SubjectUnavailable as e:
        return command_error("check", e)


def _check_campaign(args: argparse.Namespace, target: Any) -> int:
    from kvledger.checker import campaigns

    if is_subject(target) or target.bug:  # a campaign's task runs the lockstep machine on fast as it is
        print(
            "kvledger check: --tasks runs the lockstep machine on fast as it is; for a subject or a zoo bug "
            "use kvledger fuzz --tasks (with --subject, --bug)",
            file=sys.stderr,
        )
        return 2
    try:
        directory, executor = campaign_setup(args, "check")
    except (ValueError, RuntimeError) as e:
        return command_error("check", e)
    examples = args.examples or 100
    tasks = shifted(
        campaigns.check_tasks(args.profile, args.seed, args.first_task + args.tasks, examples, args.task_limit),
        args.first_task,
        args.tasks,
    )
    options = {"profile": args.profile, "seed": args.seed, "examples": examples, "first_task": args.first_task}
    try:
        text, code = campaigns.run(
            "check",
            options,
            tasks,
            executor,
            directory,
            lambda run: campaigns.merge_check(run, tasks, directory),
            campaigns.check_postfix,
        )
    except ValueError as e:
        return command_error("check", e)
    print(text)
    return code
