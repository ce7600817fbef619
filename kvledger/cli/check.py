"""`kvledger check`: the Hypothesis property run, here or as a campaign."""

from __future__ import annotations

import argparse
import os
import sys

from kvledger.cli.checker_options import add_campaign, add_subject, campaign_setup, command_error, shifted, target_of


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
        help="Hypothesis profile: ci (1500 sequences of up to 60 operations), deep (5000 of up to "
        "120), dev (40 of up to 30)",
    )
    p.add_argument("--examples", type=int, default=None, help="override the profile's number of examples")
    add_subject(p)
    p.add_argument("--bug", default=None, help="with --subject: apply this zoo bug of the subject to a copy first")
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
    if args.tasks is not None:
        return _check_campaign(args)
    if not args.subject:  # the lockstep machine runs reference against fast as they are
        from kvledger.checker.check import run_check

        return run_check(args.profile, args.examples)
    target = target_of(args, "check")
    if isinstance(target, int):
        return target
    from kvledger.checker.subject_check import run_subject_check
    from kvledger.properties.subject import SubjectUnavailable

    try:
        return run_subject_check(target, args.profile, args.examples, args.out_dir)[0]
    except SubjectUnavailable as e:
        return command_error("check", e)


def _check_campaign(args: argparse.Namespace) -> int:
    from kvledger.checker import campaigns

    if args.subject:
        print(
            "kvledger check: --tasks runs the lockstep machine; for a subject use kvledger fuzz --subject --tasks",
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
