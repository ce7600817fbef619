"""`kvledger fuzz`: random-walk fuzzing, here or as a campaign."""

from __future__ import annotations

import argparse
import sys

from kvledger.cli.checker_options import (
    add_campaign,
    add_speculate,
    add_subject,
    campaign_setup,
    command_error,
    shifted,
    target_of,
)


def add_fuzz(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fuzz",
        help="random-walk differential fuzzing of reference vs fast, or of one subject in judge mode (--subject)",
    )
    p.add_argument("--seconds", type=float, default=None, help="how long to fuzz (or --tasks and --cases)")
    p.add_argument("--workers", type=int, default=1, help="worker processes")
    p.add_argument("--seed", type=int, default=0, help="same seed and workers give the same cases")
    p.add_argument("--out-dir", default=".kvledger/fuzz", metavar="DIR", help="where failing traces go")
    p.add_argument("--bug", default=None, help="patch a bug-zoo bug into fast in every worker")
    p.add_argument("--minimize-budget", type=float, default=60.0, help="seconds to minimize a failure")
    p.add_argument(
        "--minimize-replays",
        type=int,
        default=None,
        help="also stop minimizing after this many candidate replays (the same result on any machine)",
    )
    p.add_argument(
        "--max-cases",
        type=int,
        default=None,
        help="each worker stops after this many cases (the same cases on any machine)",
    )
    p.add_argument(
        "--admission",
        default=None,
        choices=["reserve", "optimistic"],
        help="run every case under this admission policy (default: drawn per case, 40%% optimistic)",
    )
    add_subject(p)
    add_speculate(p)
    p.add_argument("--cases", type=int, default=20, help="with --tasks: the cases each task runs")
    add_campaign(p, "task i runs cases 0..--cases-1 of fuzz worker i")
    p.set_defaults(func=_fuzz)


def _fuzz(args: argparse.Namespace) -> int:
    if (args.seconds is None) == (args.tasks is None):
        print(
            "kvledger fuzz: give --seconds (fuzz for that long) or --tasks (a campaign of seeded tasks)",
            file=sys.stderr,
        )
        return 2
    if args.tasks is not None:
        return _fuzz_campaign(args)
    target = target_of(args, "fuzz")
    if isinstance(target, int):
        return target
    from kvledger.checker.fuzz import fuzz
    from kvledger.properties.subject import SubjectUnavailable

    try:
        result = fuzz(
            args.seconds,
            workers=args.workers,
            seed=args.seed,
            out_dir=args.out_dir,
            minimize_budget=args.minimize_budget,
            admission=args.admission,
            max_cases=args.max_cases,
            minimize_replays=args.minimize_replays,
            target=target,
        )
    except (KeyError, ValueError, SubjectUnavailable) as e:
        return command_error("fuzz", e)
    return result.exit_code


def _fuzz_campaign(args: argparse.Namespace) -> int:
    from kvledger.checker import campaigns

    try:
        if args.cases < 1:
            raise ValueError(f"--cases must be >= 1, got {args.cases}")
        directory, executor = campaign_setup(args, "fuzz")
    except (ValueError, RuntimeError) as e:
        return command_error("fuzz", e)
    target = target_of(args, "fuzz")
    if isinstance(target, int):
        return target
    from dataclasses import asdict

    from kvledger.checker.fuzz import TargetRecipe
    from kvledger.properties.isolation import IN_PROCESS, ISOLATED

    recipe = TargetRecipe.of(target)  # a task rebuilds the target from it
    n = args.first_task + args.tasks
    default = ISOLATED if recipe.subject is not None else IN_PROCESS  # the kind's own
    isolation = None if target.isolation == default else asdict(target.isolation)
    tasks = campaigns.fuzz_tasks(
        args.seed,
        n,
        args.cases,
        recipe.bug,
        args.admission,
        args.task_limit,
        subject=recipe.subject,
        fix=recipe.fix,
        isolation=isolation,
    )
    merge = lambda run: campaigns.merge_fuzz(  # noqa: E731
        run, tasks, directory, args.minimize_budget, args.minimize_replays
    )
    options = {"subject": recipe.subject, "fix": recipe.fix, "bug": recipe.bug, "admission": args.admission}
    tasks = shifted(tasks, args.first_task, args.tasks)
    options.update(seed=args.seed, cases=args.cases, first_task=args.first_task)
    try:
        text, code = campaigns.run("fuzz", options, tasks, executor, directory, merge, campaigns.fuzz_postfix)
    except ValueError as e:
        return command_error("fuzz", e)
    print(text)
    return code
