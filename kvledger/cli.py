"""kvledger: check and fuzz KV-cache managers, minimize failing traces, generate and serve text on
the verified engine, and benchmark it. `kvledger COMMAND --help` for each command."""

from __future__ import annotations

import argparse
import os
import sys
from typing import List

# torch's OpenMP workers spin while idle; on 2 shared cores that costs an order of magnitude
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _subject_error(command: str, e: Exception) -> int:
    print(f"kvledger {command}: {e}", file=sys.stderr)
    return 2


def _check(args: argparse.Namespace) -> int:
    os.environ["HYPOTHESIS_PROFILE"] = args.profile
    if args.subject:
        from kvledger.engine.ledger.subject import SubjectUnavailable
        from kvledger.subjects import SpecError, parse_spec
        from kvledger.tools.subject_check import run_subject_check
        from kvledger.tools.subject_replay import edits_for

        try:
            edits = edits_for(parse_spec(args.subject), fix=args.fix, bug=args.bug)
            return run_subject_check(args.subject, args.profile, args.examples, edits, args.out_dir)[0]
        except (SpecError, SubjectUnavailable, KeyError) as e:
            return _subject_error("check", e)
    from kvledger.tools.check import run_check

    return run_check(args.profile, args.examples)


def _replay(args: argparse.Namespace) -> int:
    from kvledger.engine.ledger.trace import TraceError, read
    from kvledger.tools.replay import replay_file

    try:
        named = read(args.trace)[0].subject
    except (OSError, TraceError) as e:
        return _subject_error("replay", e)
    if args.subject or named:
        from kvledger.tools.subject_replay import replay_subject_file

        return replay_subject_file(args.trace, args.subject, fix=args.fix, bug=args.bug)

    return replay_file(args.trace, device=args.device, bug=args.bug)


def _bench(args: argparse.Namespace) -> int:
    if args.output and not (args.serve or args.workload):
        print(f"kvledger bench: --output needs --serve or --workload (bench {args.what} only prints)", file=sys.stderr)
        return 2
    if getattr(args, "serve", None):
        from kvledger.bench.online import main_online_bench

        return main_online_bench(args)
    if getattr(args, "workload", None) == "shared-prefix":
        from kvledger.bench.shared_prefix import main_shared_prefix_bench

        return main_shared_prefix_bench(args)
    if getattr(args, "workload", None) == "early-stop":
        from kvledger.bench.admission import main_early_stop_bench

        return main_early_stop_bench(args)
    if getattr(args, "workload", None):
        from kvledger.bench.nano import main_nano_bench

        return main_nano_bench(args)
    if args.what == "cache":
        from kvledger.bench.cache import main

        main()
        return 0
    if args.what == "engine":
        from kvledger.bench.engine import main_bench

        return main_bench(args)
    print(f"kvledger bench: unknown benchmark {args.what!r} (available: engine, cache)", file=sys.stderr)
    return 2


def _zoo(args: argparse.Namespace) -> int:
    if args.subject:
        from kvledger.engine.ledger.subject import SubjectUnavailable
        from kvledger.subjects import SpecError
        from kvledger.tools.subject_zoo import print_subject_zoo, run_subject_zoo

        bugs = args.bugs.split(",") if args.bugs else None
        try:
            rows = run_subject_zoo(args.subject, bugs, max_cases=args.max_cases, seconds=args.fuzz_seconds)
        except (SpecError, SubjectUnavailable) as e:
            return _subject_error("zoo", e)
        print_subject_zoo(args.subject, rows)
        return 0 if all(r.caught for r in rows) else 1
    from kvledger.tools.zoo_run import main_zoo

    return main_zoo(args.bugs, args.fuzz_seconds, args.out_dir, args.hypothesis_seconds)


def _fuzz(args: argparse.Namespace) -> int:
    if args.subject:
        from kvledger.engine.ledger.subject import SubjectUnavailable
        from kvledger.subjects import SpecError, parse_spec
        from kvledger.tools.subject_fuzz import fuzz_subject, print_report
        from kvledger.tools.subject_replay import edits_for

        try:
            edits = edits_for(parse_spec(args.subject), fix=args.fix, bug=args.bug)
            report = fuzz_subject(args.subject, args.seconds, workers=args.workers, seed=args.seed,
                                  out_dir=args.out_dir, edits=edits, minimize_budget=args.minimize_budget,
                                  max_cases=args.max_cases, minimize_replays=args.minimize_replays)
        except (SpecError, SubjectUnavailable, KeyError) as e:
            return _subject_error("fuzz", e)
        print_report(args.subject, report, args.workers)
        return 1 if report.findings else 0
    from kvledger.tools.fuzz import fuzz

    try:
        result = fuzz(args.seconds, workers=args.workers, seed=args.seed, out_dir=args.out_dir, bug=args.bug,
                      minimize_budget=args.minimize_budget, admission=args.admission,
                      max_cases=args.max_cases, minimize_replays=args.minimize_replays)
    except (KeyError, ValueError) as e:
        print(f"kvledger fuzz: {e}", file=sys.stderr)
        return 2
    return result.exit_code


def _minimize(args: argparse.Namespace) -> int:
    from kvledger.engine.ledger.trace import TraceError, read

    try:
        named = read(args.trace)[0].subject
    except (OSError, TraceError) as e:
        return _subject_error("minimize", e)
    if args.subject or named:
        from kvledger.engine.ledger.subject import SubjectUnavailable
        from kvledger.subjects import SpecError
        from kvledger.tools.subject_minimize import main_minimize_subject

        try:
            return main_minimize_subject(args.trace, args.output, args.budget, args.subject, args.max_replays)
        except (SpecError, SubjectUnavailable) as e:
            return _subject_error("minimize", e)
    from kvledger.tools.minimize import main_minimize

    return main_minimize(args.trace, args.output, args.budget, args.bug, args.max_replays)


def _subjects(args: argparse.Namespace) -> int:
    from kvledger.subjects import probe_all

    rows = probe_all()
    width = max(len(r[0]) for r in rows)
    print(f"{'subject':<{width}}  installed  version       detail")
    for name, installed, version, detail in rows:
        print(f"{name:<{width}}  {'yes' if installed else 'no':<9}  {version:<12}  {detail}")
    print("a user's own subject: --subject package.module:factory (factory(SubjectConfig) -> Subject)")
    return 0


def _show(args: argparse.Namespace) -> int:
    from kvledger.tools.show import main_show

    return main_show(args.trace, args.output, args.bug)


def _coverage(args: argparse.Namespace) -> int:
    from kvledger.tools.coverage_report import main_coverage

    return main_coverage(args.examples)


def _mutation(args: argparse.Namespace) -> int:
    from kvledger.tools.mutation import main_args

    return main_args(args)


def build_parser() -> argparse.ArgumentParser:
    from kvledger.engine.cli_parser import OneLineErrorParser, add_logging_options

    from kvledger import __version__

    parser = OneLineErrorParser(prog="kvledger", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvledger {__version__}")
    add_logging_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("check", help="run the lockstep Hypothesis property run (reference vs fast), or judge mode "
                                     "on another cache manager (--subject)")
    p.add_argument("--profile", default="ci", choices=["ci", "deep", "dev"],
                   help="Hypothesis profile: ci (1500 sequences of up to 60 operations), deep (5000 of up to 120), "
                        "dev (40 of up to 30)")
    p.add_argument("--examples", type=int, default=None, help="override the profile's number of examples")
    p.add_argument("--subject", default=None, metavar="SPEC",
                   help="judge mode on this cache manager instead of reference vs fast: fast, reference, vllm, "
                        "sglang, minisgl[:PATH], nanovllm[:PATH|@COMMIT], or package.module:factory "
                        "(kvledger subjects lists them)")
    p.add_argument("--fix", default=None, help="with --subject: apply this upstream-style fix to a copy first")
    p.add_argument("--bug", default=None, help="with --subject: apply this zoo bug of the subject to a copy first")
    p.add_argument("--out-dir", default=".kvledger/failures", metavar="DIR", help="where a failing trace goes")
    p.set_defaults(func=_check)

    p = sub.add_parser("replay", help="replay a trace on reference and fast in lockstep")
    p.add_argument("trace", help="the trace file (.jsonl)")
    p.add_argument("--device", default="cpu", help="where fast's tensors live: cpu or cuda")
    p.add_argument("--bug", default=None, help="patch this bug-zoo bug into fast first (see kvledger zoo); "
                                                "with --subject, one of the subject's zoo")
    p.add_argument("--subject", default=None, metavar="SPEC",
                   help="judge mode on this cache manager instead of reference vs fast: fast, reference, vllm, "
                        "sglang, minisgl[:PATH], nanovllm[:PATH|@COMMIT], or package.module:factory "
                        "(kvledger subjects lists them)")
    p.add_argument("--fix", default=None, help="with --subject: apply this upstream-style fix to a copy first")
    p.set_defaults(func=_replay)

    from kvledger.engine.cli import add_generate_parser

    add_generate_parser(sub)
    from kvledger.engine.server.serve import add_serve_parser

    add_serve_parser(sub)  # serve has its own --log-level (default warning) and sets up its own log

    p = sub.add_parser("bench", help="benchmarks that print numbers")
    p.add_argument("what", nargs="?", default="engine", choices=["engine", "cache"],
                   help="engine: this engine vs transformers on one workload; cache: the cache manager")
    from kvledger.bench.arguments import add_bench_arguments, add_nano_bench_arguments, add_online_bench_arguments

    add_bench_arguments(p)
    add_online_bench_arguments(p)
    add_nano_bench_arguments(p)
    p.set_defaults(func=_bench)

    p = sub.add_parser("zoo", help="run the bug zoo: which property run catches each known bug")
    p.add_argument("--bugs", default=None, help="comma-separated bug names (default: all)")
    p.add_argument("--fuzz-seconds", type=float, default=10.0, help="fuzzer time per bug (0: skip)")
    p.add_argument("--hypothesis-seconds", type=float, default=45.0, help="time cap per bug for the CI profile")
    p.add_argument("--out-dir", default=None, metavar="DIR",
                   help="where to keep each bug's failing traces (default: a temp dir)")
    p.add_argument("--subject", default=None, metavar="SPEC",
                   help="judge mode on this subject's own zoo (fast: kvledger's 39 bugs); --fuzz-seconds caps each bug")
    p.add_argument("--max-cases", type=int, default=2000, help="with --subject: cases per bug at most")
    p.set_defaults(func=_zoo)

    p = sub.add_parser("fuzz", help="random-walk differential fuzzing of reference vs fast, or of one subject "
                                    "in judge mode (--subject)")
    p.add_argument("--seconds", type=float, required=True, help="how long to fuzz")
    p.add_argument("--workers", type=int, default=1, help="worker processes")
    p.add_argument("--seed", type=int, default=0, help="same seed and workers give the same cases")
    p.add_argument("--out-dir", default=".kvledger/fuzz", metavar="DIR", help="where failing traces go")
    p.add_argument("--bug", default=None, help="patch a bug-zoo bug into fast in every worker")
    p.add_argument("--minimize-budget", type=float, default=60.0, help="seconds to minimize a failure")
    p.add_argument("--minimize-replays", type=int, default=None,
                   help="also stop minimizing after this many candidate replays (the same result on any machine)")
    p.add_argument("--max-cases", type=int, default=None,
                   help="each worker stops after this many cases (the same cases on any machine)")
    p.add_argument("--admission", default=None, choices=["reserve", "optimistic"],
                   help="run every case under this admission policy (default: drawn per case, 40%% optimistic)")
    p.add_argument("--subject", default=None, metavar="SPEC",
                   help="judge mode on this cache manager instead of reference vs fast: fast, reference, vllm, "
                        "sglang, minisgl[:PATH], nanovllm[:PATH|@COMMIT], or package.module:factory "
                        "(kvledger subjects lists them)")
    p.add_argument("--fix", default=None, help="with --subject: apply this upstream-style fix to a copy first")
    p.set_defaults(func=_fuzz)

    p = sub.add_parser("minimize", help="shrink a failing trace, keeping its divergence kind")
    p.add_argument("trace", help="the failing trace (.jsonl)")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write the minimized trace")
    p.add_argument("--budget", type=float, default=60.0, help="time budget in seconds")
    p.add_argument("--max-replays", type=int, default=None,
                   help="also stop after this many candidate replays (the same result on any machine)")
    p.add_argument("--bug", default=None, help="patch a bug-zoo bug into fast first")
    p.add_argument("--subject", default=None, metavar="SPEC",
                   help="minimize on this subject (default: the one the trace's header names, if any)")
    p.set_defaults(func=_minimize)

    p = sub.add_parser("subjects", help="the cache managers kvledger can check, and whether each is installed")
    p.set_defaults(func=_subjects)

    p = sub.add_parser("show", help="draw a trace's page ownership over time (PNG)")
    p.add_argument("trace", help="the trace (.jsonl)")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the PNG to write")
    p.add_argument("--bug", default=None, help="patch a bug-zoo bug into fast first")
    p.set_defaults(func=_show)

    p = sub.add_parser("coverage", help="line and branch coverage of fast/ by the property run (ci profile)")
    p.add_argument("--examples", type=int, default=None, help="override the profile's number of examples")
    p.set_defaults(func=_coverage)

    p = sub.add_parser("mutation", help="mutation score of fast/, reference/ and the cache scheduler (cosmic-ray)")
    from kvledger.tools.mutation import add_arguments as add_mutation_arguments

    add_mutation_arguments(p)
    p.set_defaults(func=_mutation)

    for name, p in sub.choices.items():
        if name != "serve":  # serve: its own --log-level
            add_logging_options(p)
    return parser


def main(argv: List[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "serve":  # serve configures its log itself, from its own --log-level
        from kvledger.engine.cli_parser import configure_logging, log_level

        configure_logging(log_level(args))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
