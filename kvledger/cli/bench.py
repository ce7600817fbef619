"""`kvledger bench`: every benchmark's command-line options, and the benchmark each invocation runs.
Light at import: `kvledger --help` builds the parser without importing torch or the benchmarks.

`kvledger bench [engine]`: this engine vs transformers (bench/engine.py); `bench cache`: the cache
manager (bench/cache.py); `bench host`: the engine's host cost per step, model stubbed out
(bench/host.py); `--workload nano-vllm | early-stop | shared-prefix` (bench/nano.py,
admission.py, shared_prefix.py; their workloads in bench/workloads.py, their runs through
bench/runner.py); `--serve URL`: a running server (bench/online.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import fields
from typing import Any, Dict, Iterable, Optional, Tuple

from kvledger.bench.workloads import (
    EARLY_STOP,
    EARLY_STOP_RATIOS,
    NAMES,
    NANO_MAX_LEN,
    NANO_NUM_REQUESTS,
    SHARED_PREFIX,
)
from kvledger.engine.engine_config import EngineConfig

BENCH_DTYPES = ("bfloat16", "float32")
NANO_ENGINE_OPTIONS = (
    "page_size",
    "kv_cache_dtype",
    "kv_cache_tokens",
    "max_running_req",
    "max_prefill_tokens",
    "cuda_graphs",
    "overlap",
    "attention",
    "fp8_decode_kernel",
)
# options of --workload nano-vllm that early-stop shares but defaults otherwise, by device
EARLY_STOP_SHARED = ("num_requests", "max_input_len", "model_config")


class _Given(argparse.Action):
    """Store the value and note the option as given (in `namespace.given`): `--workload early-stop`
    picks its own, device-dependent defaults for the shared options left out."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = frozenset(getattr(namespace, "given", frozenset())) | {self.dest}


# dest -> (type, default, help); the flag is --DEST-WITH-DASHES
Flags = Dict[str, Tuple[Optional[type], Any, str]]

ENGINE_BENCH_FLAGS: Flags = {
    "prompts": (int, 32, "number of requests"),
    "min_len": (int, 32, "shortest prompt, tokens"),
    "max_len": (int, 256, "longest prompt, tokens"),
    "output_len": (int, 64, "tokens generated per request"),
}
ONLINE_FLAGS: Flags = {
    "request_rate": (float, math.inf, "Poisson arrival rate in requests/s (default inf: all at once)"),
    "max_concurrency": (int, None, "at most this many requests in flight (default: no limit)"),
    "shared_prefix_len": (int, 0, "tokens of prefix shared within each group of prompts"),
    "prefix_groups": (int, 1, "number of shared prefixes"),
    "api_key": (None, None, "sent as 'Authorization: Bearer KEY'"),
    "served_model": (None, None, "model id (default: the server's)"),
}
NANO_FLAGS: Flags = {
    "hf_attn": (None, "sdpa", "transformers attn_implementation (continuous batching may switch sdpa to flash)"),
    "hf_max_batch_tokens": (int, None, "transformers' max_batch_tokens (default: its own on CUDA, 2048 on CPU)"),
    "bandwidth_bytes": (int, None, "bytes copied to measure bandwidth (default 2 GiB on CUDA, 64 MiB on CPU)"),
    "bandwidth_gbs": (float, None, "use this bandwidth (GB/s) for the floor instead of measuring"),
    "profile_requests": (
        int,
        256,
        "requests in the profiled decode batch, the workload's first prompts (0: no profile)",
    ),
    "profile_output_len": (int, 32, "tokens each profiled request generates"),
}
EARLY_STOP_FLAGS: Flags = {
    "max_tokens": (
        int,
        None,
        "max_tokens of every request, all the scheduler knows (default: 2048 on CUDA, 256 on the CPU)",
    ),
    "output_median": (float, None, "median of the lognormal output lengths, tokens (default: max_tokens * 200 / 2048)"),
    "output_sigma": (float, 1.0, "sigma of the lognormal output lengths (the tail); lengths are capped at max_tokens"),
    "policies": (
        None,
        "reserve,optimistic",
        "admission policies, comma-separated: reserve runs first (always), each other policy once per --ratios entry",
    ),
    "ratios": (None, EARLY_STOP_RATIOS, "reserve ratios of the preempting policies, comma-separated"),
}
SHARED_PREFIX_FLAGS: Flags = {
    "groups": (int, 32, "groups of requests, one shared prefix each"),
    "group_size": (int, 16, "requests per group"),
    "prefix_len": (int, 2048, "tokens of each group's prefix"),
    "question_len": (int, 256, "tokens each request adds after its group's prefix"),
    "answer_len": (int, 256, "tokens each request generates"),
    "caches": (
        None,
        "radix,naive",
        "caches to run in turn, comma-separated: radix (with cascade decode "
        "attention), radix-flat (radix without it), naive",
    ),
}


def _add_flags(g: Any, flags: Flags) -> None:
    for dest, (kind, default, text) in flags.items():
        g.add_argument("--" + dest.replace("_", "-"), dest=dest, type=kind, default=default, help=text)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks that print numbers")
    p.add_argument(
        "what",
        nargs="?",
        default="engine",
        choices=["engine", "cache", "host"],
        help="engine: this engine vs transformers on one workload; cache: the cache manager; host: the "
        "engine's host cost per step on the nano-vllm workload (--num-requests, --seed), model stubbed out",
    )
    p.add_argument("--cprofile", action="store_true", help="bench host: also print cProfile's top functions")
    _add_engine_arguments(p)
    _add_online_arguments(p)
    _add_workload_arguments(p)
    p.set_defaults(func=bench_command)


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    _add_flags(p, ENGINE_BENCH_FLAGS)
    p.add_argument(
        "--dtype",
        default=None,
        choices=list(BENCH_DTYPES),
        help="weights and activations (default: float32; with --workload nano-vllm: bfloat16 on CUDA, float32 on CPU)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts (and of random weights)")
    p.add_argument("--skip-transformers", action="store_true", help="run this engine only")
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file or HF directory (default: the embedded model; "
        "with --workload nano-vllm: real weights instead of --model-config's random ones)",
    )


def _add_online_arguments(p: argparse.ArgumentParser) -> None:
    """--serve's own options; it shares --prompts, --min-len, --max-len, --output-len and --seed."""
    p.add_argument(
        "--serve",
        metavar="URL",
        default=None,
        help="benchmark a running server at URL (e.g. http://127.0.0.1:8000) instead of offline",
    )
    _add_flags(p, ONLINE_FLAGS)
    p.add_argument(
        "-o",
        "--output",
        dest="output",
        default=None,
        metavar="FILE.json",
        help="with --serve or --workload: also write the figures as JSON (nano-vllm: every raw number)",
    )
    p.add_argument("--no-progress", dest="no_progress", action="store_true", help="--serve: no progress bar")


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """--workload and its options. --dtype, --seed, --threads and --model are the engine benchmark's,
    -o/--output --serve's."""
    p.set_defaults(given=frozenset())
    g = p.add_argument_group("--workload nano-vllm (GPU throughput benchmark)")
    g.add_argument(
        "--workload",
        default=None,
        choices=list(NAMES),
        help="nano-vllm: its offline workload (256 requests, 142,827 in / 133,966 out tokens); "
        "early-stop: outputs end before max_tokens, unknown to the scheduler (reserve vs "
        "optimistic admission); shared-prefix: groups of requests sharing a long prefix, "
        "radix vs naive cache",
    )
    g.add_argument(
        "--num-requests",
        dest="num_requests",
        type=int,
        default=NANO_NUM_REQUESTS,
        action=_Given,
        help="requests in the workload (its first N; early-stop: 256 on CUDA, 24 on the CPU)",
    )
    g.add_argument(
        "--max-input-len",
        dest="max_input_len",
        type=int,
        default=NANO_MAX_LEN,
        action=_Given,
        help="longest prompt (shortest: 100/1024 of it; early-stop: 1024 on CUDA, 128 on the CPU)",
    )
    g.add_argument(
        "--max-output-len",
        dest="max_output_len",
        type=int,
        default=NANO_MAX_LEN,
        help="largest max_tokens (smallest: 100/1024 of it)",
    )
    g.add_argument(
        "--model-config",
        dest="model_config",
        default="qwen3-0.6b",
        action=_Given,
        help="shipped config (qwen3-0.6b, smollm2-135m) or a config.json, random weights "
        "(early-stop on the CPU without it: the embedded model)",
    )
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    g.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tensor_parallel_sizes",
        default="1",
        metavar="N[,N...]",
        help="tensor-parallel sizes, comma-separated: each runs the workload in turn (1,2: TP=1 "
        "then TP=2 in one run, with their ratio and each one's profile, all-reduce time "
        "included)",
    )
    g.add_argument(
        "--compare", default="none", choices=["none", "transformers"], help="also run transformers' continuous batching"
    )
    _add_flags(g, NANO_FLAGS)
    # the engine's own options, from its one config (with this workload's defaults)
    kv_help = (
        "KV pool size in tokens (default: from free GPU memory where the engine can, else the "
        "workload's need; early-stop: ceil(min(max_running_req, requests) / 8) worst cases, the "
        "longest prompt plus max_tokens each)"
    )
    EngineConfig.add_arguments(
        p,
        only=NANO_ENGINE_OPTIONS,
        title="--workload nano-vllm: engine options",
        defaults={"max_running_req": 256, "max_prefill_tokens": 16384, "cuda_graphs": None},
        helps={"kv_cache_tokens": kv_help},
    )
    g = p.add_argument_group(
        "--workload early-stop (reserve vs optimistic admission; also --num-requests, "
        "--max-input-len, --model-config, --device and the engine options above)"
    )
    _add_flags(g, EARLY_STOP_FLAGS)
    g = p.add_argument_group(
        "--workload shared-prefix (SGLang's generated-shared-prefix style; also "
        "--model-config, --device, --dtype, --seed and the engine options above)"
    )
    _add_flags(g, SHARED_PREFIX_FLAGS)


# -- from the namespace to a benchmark --------------------------------------------------------------
def _options(cls: type, args: argparse.Namespace, leave_out: Iterable[str] = ()) -> Any:
    """`cls` (a benchmark's options dataclass) from the fields the namespace has."""
    skip = set(leave_out)
    return cls(
        **{
            f.name: getattr(args, f.name)
            for f in fields(cls)
            if f.init and f.name not in skip and hasattr(args, f.name)
        }
    )


def nano_options(args: argparse.Namespace) -> Any:
    from kvledger.bench.nano import NanoOptions

    return _options(NanoOptions, args)  # overlap: None/True/False


def early_stop_options(args: argparse.Namespace) -> Any:
    """The early-stop options; the ones it shares with nano-vllm (--num-requests, --max-input-len,
    --model-config) count only if given."""
    from kvledger.bench.admission import EarlyStopOptions

    return _options(EarlyStopOptions, args, set(EARLY_STOP_SHARED) - getattr(args, "given", frozenset()))


def shared_prefix_options(args: argparse.Namespace) -> Any:
    from kvledger.bench.shared_prefix import SharedPrefixOptions

    return _options(SharedPrefixOptions, args)


def _workload(args: argparse.Namespace) -> int:
    """Run --workload's benchmark: exit status 0 when every token count is right, 1 when one is
    not, 2 for options it refuses."""
    try:
        if args.workload == SHARED_PREFIX:
            from kvledger.bench.shared_prefix import run_shared_prefix_bench

            report = run_shared_prefix_bench(shared_prefix_options(args))
        elif args.workload == EARLY_STOP:
            from kvledger.bench.admission import run_early_stop_bench

            report = run_early_stop_bench(early_stop_options(args))
        else:
            from kvledger.bench.nano import run_nano_bench

            report = run_nano_bench(nano_options(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"kvledger bench --workload {args.workload}: {e}", file=sys.stderr)
        return 2
    return 0 if report["ok"] else 1


def _online(args: argparse.Namespace) -> int:
    """Run the online benchmark against --serve URL."""
    import asyncio

    import httpx

    from kvledger.bench.online import format_report, run_online
    from kvledger.bench.workloads import online

    try:
        workload = online(
            args.prompts,
            args.min_len,
            args.max_len,
            args.output_len,
            args.shared_prefix_len,
            args.prefix_groups,
            args.seed,
        )
        summary = asyncio.run(
            run_online(
                args.serve,
                workload,
                request_rate=args.request_rate,
                max_concurrency=args.max_concurrency,
                api_key=args.api_key,
                model=args.served_model,
                seed=args.seed,
                progress=not args.no_progress,
            )
        )
    except (ValueError, httpx.HTTPError) as e:
        print(f"kvledger bench --serve: {e}", file=sys.stderr)
        return 2
    print(format_report(summary))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1


def bench_command(args: argparse.Namespace) -> int:
    if args.output and not (args.serve or args.workload):
        print(f"kvledger bench: --output needs --serve or --workload (bench {args.what} only prints)", file=sys.stderr)
        return 2
    if args.serve:
        return _online(args)
    if args.workload:
        return _workload(args)
    if args.what == "cache":
        from kvledger.bench.cache import main
        from kvledger.checker.audit.lockstep_bench import main as lockstep_main

        main()
        lockstep_main()
        return 0
    if args.what == "host":
        from kvledger.bench.host import main as host_main

        try:
            cost = host_main(args.num_requests, args.seed, args.cprofile, args.device or "cpu")
        except ValueError as e:
            print(f"kvledger bench host: {e}", file=sys.stderr)
            return 2
        return 0 if cost.tokens == cost.expected_tokens else 1
    from kvledger.bench.engine import run_bench

    run_bench(
        prompts=args.prompts,
        min_len=args.min_len,
        max_len=args.max_len,
        output_len=args.output_len,
        dtype=args.dtype or "float32",
        threads=args.threads,
        seed=args.seed,
        skip_transformers=args.skip_transformers,
        model_path=args.model,
    )
    return 0
