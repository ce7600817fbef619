"""What the checker's commands share: --subject/--fix and the campaign options, and the one
target a command runs on."""

from __future__ import annotations

import argparse
import sys
from typing import Any

SUBJECT_HELP = (
    "judge mode on this cache manager instead of reference vs fast: fast, reference, vllm, "
    "sglang, minisgl[:PATH], nanovllm[:PATH|@COMMIT], or package.module:factory (kvledger "
    "subjects lists them)"
)


def command_error(command: str, e: Exception) -> int:
    print(f"kvledger {command}: {e}", file=sys.stderr)
    return 2


def target_of(args: argparse.Namespace, command: str, named: str | None = None) -> Any:
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
            speculate=getattr(args, "speculate", False),
            isolation=isolation_of(args),
            isolate=isolate_of(args),
        )
    except (SpecError, SubjectUnavailable, KeyError, ValueError) as e:
        return command_error(command, e)


def isolation_of(args: argparse.Namespace) -> Any:
    """The `Isolation` --isolation, --memory-cap and --hang-limit ask for; under auto (the
    default) `enabled` is left to the target's kind (`targets.target_for`)."""
    from kvledger.properties.isolation import Isolation

    default = Isolation()
    cap, hang = getattr(args, "memory_cap", None), getattr(args, "hang_limit", None)
    return Isolation(
        enabled=getattr(args, "isolation", "auto") != "off",
        memory_cap_mb=default.memory_cap_mb if cap is None else cap,
        hang_limit_s=default.hang_limit_s if hang is None else hang,
    )


def isolate_of(args: argparse.Namespace) -> bool | None:
    """--isolation on/off as a decision, auto as None (the kind's default)."""
    return {"on": True, "off": False}.get(getattr(args, "isolation", "auto"))


def is_subject(target: Any) -> bool:
    from kvledger.properties.target import SubjectTarget

    return isinstance(target, SubjectTarget)


def add_subject(p: argparse.ArgumentParser) -> None:
    """--subject SPEC and --fix NAME: judge mode on another cache manager, optionally fixed first."""
    p.add_argument("--subject", default=None, metavar="SPEC", help=SUBJECT_HELP)
    p.add_argument("--fix", default=None, help="with --subject: apply this upstream-style fix to a copy first")
    add_isolation(p)


def add_isolation(p: argparse.ArgumentParser) -> None:
    """--isolation, --memory-cap, --hang-limit: how a subject's death is kept from the checker."""
    from kvledger.properties.isolation import DEFAULT_MEMORY_CAP_MB, HANG_LIMIT_S

    g = p.add_argument_group(
        "isolation",
        "a subject runs in a child process, so that a segfault, an exit or a runaway allocation of its "
        "own is a finding with its trace (subject-crashed:SIGSEGV, subject-oom, ...), not a dead checker",
    )
    g.add_argument(
        "--isolation",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto (default): subjects isolated, reference vs fast (kvledger's own code) in process",
    )
    g.add_argument(
        "--memory-cap",
        type=int,
        default=None,
        metavar="MB",
        help=f"what an isolated child may allocate beyond what it inherits (default {DEFAULT_MEMORY_CAP_MB}; 0: none)",
    )
    g.add_argument(
        "--hang-limit",
        type=float,
        default=None,
        metavar="S",
        help=f"kill an isolated child that starts no operation for this long: subject-hung (default {HANG_LIMIT_S:g})",
    )


def add_speculate(p: argparse.ArgumentParser) -> None:
    """--speculate: lockstep runs whose decodes verify drafts (a zoo bug of fast's speculation turns it on)."""
    p.add_argument(
        "--speculate",
        action="store_true",
        help="lockstep: reference and fast speculate (each decode verifies 1-4 drafts per request, accepting some)",
    )


def add_campaign(p: argparse.ArgumentParser, what: str) -> None:
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


def campaign_setup(args: argparse.Namespace, command: str):
    from kvledger.campaign import CampaignDir, executor_for

    if args.tasks < 1:
        raise ValueError(f"--tasks must be >= 1, got {args.tasks}")
    if args.first_task < 0:
        raise ValueError(f"--first-task must be >= 0, got {args.first_task}")
    directory = CampaignDir(args.campaign or f".kvledger/campaigns/{command}-seed{args.seed}")
    return directory, executor_for(args.cluster, args.workers)


def shifted(tasks, first: int, count: int):
    return tasks[first : first + count]
