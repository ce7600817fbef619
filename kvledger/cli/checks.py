"""The checker's commands: check, replay, zoo, fuzz, minimize, subjects, show and coverage. Each
`add_*` registers one subcommand; its handler imports the tool it runs only when it runs."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

SUBJECT_HELP = (
    "judge mode on this cache manager instead of reference vs fast: fast, reference, vllm, "
    "sglang, minisgl[:PATH], nanovllm[:PATH|@COMMIT], or package.module:factory (kvledger "
    "subjects lists them)"
)


def _subject_error(command: str, e: Exception) -> int:
    print(f"kvledger {command}: {e}", file=sys.stderr)
    return 2


def _target(args: argparse.Namespace, command: str, named: str | None = None) -> Any:
    """The one target a command runs on, from --subject (or the subject a trace's header names),
    --fix and --bug: a subject in judge mode, or reference against fast with fast's zoo bug. An
    exit status (2) when the spec, the fix or the bug is unknown or the subject is not installed."""
    from kvledger.checker.targets import target_for
    from kvledger.properties.subject import SubjectUnavailable
    from kvledger.subjects import SpecError

    try:
        return target_for(
            args.subject,
            fix=getattr(args, "fix", None),
            bug=args.bug,
            device=getattr(args, "device", "cpu"),
            named=named,
        )
    except (SpecError, SubjectUnavailable, KeyError) as e:
        return _subject_error(command, e)


def _is_subject(target: Any) -> bool:
    from kvledger.properties.target import SubjectTarget

    return isinstance(target, SubjectTarget)


def _add_subject(p: argparse.ArgumentParser) -> None:
    """--subject SPEC and --fix NAME: judge mode on another cache manager, optionally fixed first."""
    p.add_argument("--subject", default=None, metavar="SPEC", help=SUBJECT_HELP)
    p.add_argument("--fix", default=None, help="with --subject: apply this upstream-style fix to a copy first")


def _add_campaign(p: argparse.ArgumentParser, what: str) -> None:
    g = p.add_argument_group("campaign", f"run as a campaign of seeded tasks ({what}), here or on a Ray cluster")
    g.add_argument("--tasks", type=int, default=None, metavar="N", help="run as a campaign of N tasks")
    g.add_argument("--first-task", type=int, default=0, metavar="K", help="the campaign's tasks are K..K+N-1")
    g.add_argument(
        "--cluster",
        default=None,
        metavar="ADDRESS",
        help="run the tasks on this Ray cluster (auto: the one this machine is in; local: start one here "
        "with --workers CPUs); needs kvledger[cluster]",
    )
    g.add_argument(
        "--campaign",
        default=None,
        metavar="DIR",
        help="the campaign directory: outcomes, findings, summary; a second campaign over it resumes "
        "(default .kvledger/campaigns/<command>-seed<seed>)",
    )
    g.add_argument(
        "--task-limit", type=float, default=1800.0, metavar="S", help="a task running longer is stopped as hung"
    )


def _campaign_setup(args: argparse.Namespace, command: str):
    from kvledger.campaign import CampaignDir, executor_for

    if args.tasks < 1:
        raise ValueError(f"--tasks must be >= 1, got {args.tasks}")
    if args.first_task < 0:
        raise ValueError(f"--first-task must be >= 0, got {args.first_task}")
    directory = CampaignDir(args.campaign or f".kvledger/campaigns/{command}-seed{args.seed}")
    return directory, executor_for(args.cluster, args.workers)


def _shifted(tasks, first: int, count: int):
    return tasks[first : first + count]


# -- check ------------------------------------------------------------------------------------------
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
    _add_subject(p)
    p.add_argument("--bug", default=None, help="with --subject: apply this zoo bug of the subject to a copy first")
    p.add_argument("--out-dir", default=".kvledger/failures", metavar="DIR", help="where a failing trace goes")
    p.add_argument(
        "--seed", type=int, default=0, help="with --tasks: task i runs under a Hypothesis seed from (seed, i)"
    )
    p.add_argument(
        "--workers", type=int, default=1, help="with --tasks: worker processes here (or CPUs of --cluster local)"
    )
    _add_campaign(p, "each a Hypothesis run of --examples sequences with its own seed")
    p.set_defaults(func=_check)


def _check(args: argparse.Namespace) -> int:
    os.environ["HYPOTHESIS_PROFILE"] = args.profile
    if args.tasks is not None:
        return _check_campaign(args)
    if not args.subject:  # the lockstep machine runs reference against fast as they are
        from kvledger.checker.check import run_check

        return run_check(args.profile, args.examples)
    target = _target(args, "check")
    if isinstance(target, int):
        return target
    from kvledger.checker.subject_check import run_subject_check
    from kvledger.properties.subject import SubjectUnavailable

    try:
        return run_subject_check(target, args.profile, args.examples, args.out_dir)[0]
    except SubjectUnavailable as e:
        return _subject_error("check", e)


def _check_campaign(args: argparse.Namespace) -> int:
    from kvledger.checker import campaigns

    if args.subject:
        print(
            "kvledger check: --tasks runs the lockstep machine; for a subject use kvledger fuzz --subject --tasks",
            file=sys.stderr,
        )
        return 2
    try:
        directory, executor = _campaign_setup(args, "check")
    except (ValueError, RuntimeError) as e:
        return _subject_error("check", e)
    examples = args.examples or 100
    tasks = _shifted(
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
        return _subject_error("check", e)
    print(text)
    return code


# -- replay -----------------------------------------------------------------------------------------
def add_replay(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="replay a trace on reference and fast in lockstep")
    p.add_argument("trace", help="the trace file (.jsonl)")
    p.add_argument("--device", default="cpu", help="where fast's tensors live: cpu or cuda")
    p.add_argument(
        "--bug",
        default=None,
        help="patch this bug-zoo bug into fast first (see kvledger zoo); with --subject, one of the subject's zoo",
    )
    _add_subject(p)
    p.set_defaults(func=_replay)


def _named_subject(command: str, trace: str) -> str | int | None:
    """The subject the trace's header names (None: reference vs fast), or exit status 2 for a trace
    that cannot be read."""
    from kvledger.engine.ledger.trace import TraceError, read

    try:
        return read(trace)[0].subject
    except (OSError, TraceError) as e:
        return _subject_error(command, e)


def _replay(args: argparse.Namespace) -> int:
    named = _named_subject("replay", args.trace)
    if isinstance(named, int):
        return named
    target = _target(args, "replay", named)
    if isinstance(target, int):
        return target
    from kvledger.checker.replay import replay_trace

    return replay_trace(args.trace, target)


# -- zoo --------------------------------------------------------------------------------------------
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
            return _subject_error("zoo", e)
        print_subject_zoo(args.subject, rows)
        return 0 if all(r.caught for r in rows) else 1
    from kvledger.checker.audit.zoo_run import main_zoo

    return main_zoo(
        args.bugs, args.fuzz_seconds, args.out_dir, args.hypothesis_seconds, args.hypothesis_sequences, args.fuzz_cases
    )


# -- fuzz -------------------------------------------------------------------------------------------
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
    _add_subject(p)
    p.add_argument("--cases", type=int, default=20, help="with --tasks: the cases each task runs")
    _add_campaign(p, "task i runs cases 0..--cases-1 of fuzz worker i")
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
    target = _target(args, "fuzz")
    if isinstance(target, int):
        return target
    if _is_subject(target):
        from kvledger.checker.subject_fuzz import fuzz_subject, print_report
        from kvledger.properties.subject import SubjectUnavailable
        from kvledger.subjects import SpecError

        try:
            report = fuzz_subject(
                target.name,
                args.seconds,
                workers=args.workers,
                seed=args.seed,
                out_dir=args.out_dir,
                edits=target.edits,
                minimize_budget=args.minimize_budget,
                max_cases=args.max_cases,
                minimize_replays=args.minimize_replays,
            )
        except (SpecError, SubjectUnavailable, KeyError) as e:
            return _subject_error("fuzz", e)
        print_report(target.name, report, args.workers)
        return 1 if report.findings else 0
    from kvledger.checker.fuzz import fuzz

    try:
        result = fuzz(
            args.seconds,
            workers=args.workers,
            seed=args.seed,
            out_dir=args.out_dir,
            bug=target.bug,
            minimize_budget=args.minimize_budget,
            admission=args.admission,
            max_cases=args.max_cases,
            minimize_replays=args.minimize_replays,
        )
    except (KeyError, ValueError) as e:
        return _subject_error("fuzz", e)
    return result.exit_code


def _fuzz_campaign(args: argparse.Namespace) -> int:
    from kvledger.checker import campaigns

    try:
        if args.cases < 1:
            raise ValueError(f"--cases must be >= 1, got {args.cases}")
        directory, executor = _campaign_setup(args, "fuzz")
    except (ValueError, RuntimeError) as e:
        return _subject_error("fuzz", e)
    n = args.first_task + args.tasks
    budget, replays = args.minimize_budget, args.minimize_replays
    if args.subject:
        tasks = campaigns.subject_tasks(args.subject, args.seed, n, args.cases, args.fix, args.bug, args.task_limit)
        merge = lambda run: campaigns.merge_subject(run, tasks, directory, budget, replays)  # noqa: E731
        options = {"subject": args.subject, "fix": args.fix, "bug": args.bug}
    else:
        tasks = campaigns.fuzz_tasks(args.seed, n, args.cases, args.bug, args.admission, args.task_limit)
        merge = lambda run: campaigns.merge_fuzz(run, tasks, directory, budget, replays)  # noqa: E731
        options = {"bug": args.bug, "admission": args.admission}
    tasks = _shifted(tasks, args.first_task, args.tasks)
    options.update(seed=args.seed, cases=args.cases, first_task=args.first_task)
    try:
        text, code = campaigns.run("fuzz", options, tasks, executor, directory, merge, campaigns.fuzz_postfix)
    except ValueError as e:
        return _subject_error("fuzz", e)
    print(text)
    return code


# -- minimize ---------------------------------------------------------------------------------------
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
    p.set_defaults(func=_minimize)


def _minimize(args: argparse.Namespace) -> int:
    named = _named_subject("minimize", args.trace)
    if isinstance(named, int):
        return named
    target = _target(args, "minimize", named)
    if isinstance(target, int):
        return target
    from kvledger.checker.minimize import main_minimize
    from kvledger.properties.subject import SubjectUnavailable

    try:
        return main_minimize(args.trace, args.output, args.budget, max_replays=args.max_replays, target=target)
    except SubjectUnavailable as e:
        return _subject_error("minimize", e)


# -- subjects, show, coverage -----------------------------------------------------------------------
def add_subjects(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("subjects", help="the cache managers kvledger can check, and whether each is installed")
    p.set_defaults(func=_subjects)


def _subjects(args: argparse.Namespace) -> int:
    from kvledger.subjects import probe_all

    rows = probe_all()
    width = max(len(r[0]) for r in rows)
    print(f"{'subject':<{width}}  installed  version       detail")
    for name, installed, version, detail in rows:
        print(f"{name:<{width}}  {'yes' if installed else 'no':<9}  {version:<12}  {detail}")
    print("a user's own subject: --subject package.module:factory (factory(SubjectConfig) -> Subject)")
    return 0


def add_show(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="draw a trace's page ownership over time (PNG)")
    p.add_argument("trace", help="the trace (.jsonl)")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the PNG to write")
    p.add_argument("--bug", default=None, help="patch a bug-zoo bug into fast first")
    p.set_defaults(func=_show)


def _show(args: argparse.Namespace) -> int:
    from kvledger.checker.show import main_show
    from kvledger.checker.targets import lockstep_target

    return main_show(args.trace, args.output, target=lockstep_target(args.bug))


def add_coverage(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coverage", help="line and branch coverage of fast/ by the property run (ci profile)")
    p.add_argument("--examples", type=int, default=None, help="override the profile's number of examples")
    p.set_defaults(func=_coverage)


def _coverage(args: argparse.Namespace) -> int:
    from kvledger.checker.audit.coverage_report import main_coverage

    return main_coverage(args.examples)
