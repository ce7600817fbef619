"""`kvledger subjects`, `kvledger show` and `kvledger coverage`."""

from __future__ import annotations

import argparse


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
    import coverage  # noqa: F401  (here, not only in the run's subprocess: a missing 'tools' extra is named)

    from kvledger.checker.audit.coverage_report import main_coverage

    return main_coverage(args.examples)
