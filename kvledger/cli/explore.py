"""`kvledger explore`: visit every state of a small scope breadth-first (kvledger/checker/explore.py).

A named scope (`--scope ci|small|large|bug-...`) or its parameters one by one (each flag overrides
the named scope's value). The report (stdout): the scope, states, transitions, depth, exhausted or
cut, states/s and memory, and each divergence's shortest counterexample, written as a trace that
`kvledger replay` and `kvledger show` read. Progress goes to stderr (a bar on a terminal, else a line
every 10 s). Ctrl-C, SIGTERM or `--seconds` stop the search and print the report so far, marked
PARTIAL. Exit 0: no divergence; 1: a divergence; 2: bad usage."""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType

from kvledger.cli.checker_options import add_isolation


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explore",
        help="breadth-first exploration of every state of a small scope (shortest counterexamples)",
        description=__doc__,
    )
    p.add_argument("--scope", default="ci", help="a named scope: ci, small, large, or a bug-hunting one (--list)")
    p.add_argument("--list", action="store_true", help="print the named scopes and exit")
    g = p.add_argument_group("scope parameters", "each overrides the named scope's value")
    g.add_argument("--pages", type=int, default=None, help="pool pages")
    g.add_argument("--page-size", type=int, default=None, help="tokens per page")
    g.add_argument("--table-slots", type=int, default=None, help="page-table rows (requests admitted at once)")
    g.add_argument("--cache", choices=["radix", "naive"], default=None, help="prefix cache kind")
    g.add_argument(
        "--admission", choices=["reserve", "optimistic", "adaptive"], default=None, help="the admission policy"
    )
    g.add_argument(
        "--reserve-ratio", type=float, default=None, help="optimistic/adaptive: the share of max_tokens reserved"
    )
    g.add_argument("--prompts", default=None, metavar="P;P", help="the prompt alphabet, e.g. '0;0,0;1,0'")
    g.add_argument("--max-tokens", default=None, metavar="N,N", help="max_tokens values, e.g. 1,2")
    g.add_argument("--budgets", default=None, metavar="N,N", help="prefill budgets, e.g. 1,8")
    g.add_argument("--samples", default=None, metavar="S;S", help="sampled token lists, e.g. '0;1' (default: one, [])")
    g.add_argument("--evicts", default=None, metavar="N,N", help="evict sizes in tokens (all evictable too)")
    g.add_argument(
        "--ops", default=None, help="enabled operations: submit,prefill,decode,finish,abort,evict,probe,idle"
    )
    g.add_argument("--max-live", type=int, default=None, help="requests in the system at once")
    g.add_argument("--max-depth", type=int, default=None, help="cut the search at this many operations")
    g.add_argument("--max-states", type=int, default=None, help="cut the search at this many states")
    p.add_argument("--bug", default=None, help="patch this bug-zoo bug into fast (or, with --subject, the subject's)")
    p.add_argument("--subject", default=None, metavar="SPEC", help="explore this subject in judge mode instead")
    p.add_argument("--fix", default=None, help="with --subject: apply this upstream-style fix first")
    add_isolation(p)
    p.add_argument(
        "--path",
        choices=["copy", "replay"],
        default="copy",
        help="reach a successor by deep-copying its parent (copy) or replaying its path from the start (replay)",
    )
    p.add_argument("--plain", action="store_true", help="exact-state keys, no renaming of uids and pages")
    p.add_argument("--no-merge", action="store_true", help="no state merging at all (a plain tree search)")
    p.add_argument("--all-kinds", action="store_true", help="go on after a divergence: every kind's shortest one")
    p.add_argument("--out-dir", default=".kvledger/explore", metavar="DIR", help="where counterexamples go")
    p.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="a safety cap on wall time: stop there and report the states so far as PARTIAL (--max-states decides)",
    )
    p.set_defaults(func=run)


def scope_from_args(args: argparse.Namespace):
    """The named scope with the command line's overrides (ValueError or KeyError when bad)."""
    from kvledger.checker.explore import parse_ints, parse_prompts
    from kvledger.checker.explore_scope import SCOPES

    if args.scope not in SCOPES:
        raise KeyError(f"unknown scope {args.scope!r}; named scopes: {', '.join(SCOPES)}")
    scope = SCOPES[args.scope]
    changes = {}
    simple = {
        "pages": "num_pages",
        "page_size": "page_size",
        "table_slots": "table_slots",
        "cache": "cache_type",
        "admission": "admission",
        "reserve_ratio": "reserve_ratio",
        "max_live": "max_live",
        "max_depth": "max_depth",
        "max_states": "max_states",
    }
    for flag, name in simple.items():
        if getattr(args, flag) is not None:
            changes[name] = getattr(args, flag)
    if args.prompts is not None:
        changes["prompts"] = parse_prompts(args.prompts)
    if args.max_tokens is not None:
        changes["max_tokens"] = parse_ints(args.max_tokens)
    if args.budgets is not None:
        changes["budgets"] = parse_ints(args.budgets)
    if args.samples is not None:
        changes["samples"] = tuple(tuple(s) for s in parse_prompts(args.samples)) or ((),)
    if args.evicts is not None:
        changes["evicts"] = parse_ints(args.evicts)
    if args.ops is not None:
        changes["ops"] = frozenset(o.strip() for o in args.ops.split(",") if o.strip())
    if changes:
        scope = scope.with_(name=scope.name + "+" if any(k != "max_depth" for k in changes) else scope.name, **changes)
    return scope


def run(args: argparse.Namespace) -> int:
    from kvledger.checker.explore import explore, format_result
    from kvledger.checker.explore_scope import SCOPES

    if args.list:
        for scope in SCOPES.values():
            print(scope.describe() + "\n")
        return 0
    try:
        scope = scope_from_args(args)
    except (KeyError, ValueError) as e:
        print(f"kvledger explore: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    from kvledger.checker.targets import target_for
    from kvledger.cli.checker_options import isolate_of, isolation_of
    from kvledger.properties.subject import SubjectUnavailable
    from kvledger.subjects import SpecError

    try:
        target = target_for(
            args.subject, fix=args.fix, bug=args.bug, isolation=isolation_of(args), isolate=isolate_of(args)
        )
    except (SpecError, SubjectUnavailable, KeyError, ValueError) as e:
        print(f"kvledger explore: {e}", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a timeout's SIGTERM reports as Ctrl-C does
    try:
        result = explore(
            scope,
            target=target,
            path=args.path,
            canonical=not args.plain,
            merge=not args.no_merge,
            all_kinds=args.all_kinds,
            out_dir=args.out_dir,
            seconds=args.seconds,
        )
    except KeyError as e:  # an unknown zoo bug
        print(f"kvledger explore: {e.args[0]}", file=sys.stderr)
        return 2
    except SubjectUnavailable as e:
        print(f"kvledger explore: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    for warning in result.warnings:
        print(f"kvledger explore: WARNING: {warning}", file=sys.stderr)
    print(format_result(result), flush=True)
    return result.exit_code


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt
