"""`kvledger generate`: stream a completion of one prompt to the terminal."""

from __future__ import annotations

import argparse
import functools
import sys

from kvledger.engine.options import ATTENTION_BACKENDS, CACHE_TYPES, EngineOptionError
ENGINE_OPTIONS = ("model", "dtype", "page_size", "cache_type", "kv_cache_tokens", "max_running_reqs",
                  "max_seq_len", "max_prefill_tokens", "verify", "trace", "seed", "dummy_weights", "threads",
                  "device", "attention", "cuda_graphs", "overlap")  # LLM's keywords; every one is a flag's dest


def add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or a Hugging Face directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--page-size", dest="page_size", type=int, default=16)
    p.add_argument("--cache", dest="cache_type", default="radix", choices=CACHE_TYPES)
    p.add_argument("--kv-cache-tokens", dest="kv_cache_tokens", type=int, default=None,
                   help="KV pool size in tokens, rounded down to whole pages "
                        "(default: 32768 on the CPU, from free memory on CUDA)")
    p.add_argument("--max-running-reqs", dest="max_running_reqs", type=int, default=64)
    p.add_argument("--max-seq-len", dest="max_seq_len", type=int, default=None)
    p.add_argument("--max-prefill-tokens", dest="max_prefill_tokens", type=int, default=2048)
    p.add_argument("--verify", action="store_true", help="shadow every cache operation in the reference model")
    p.add_argument("--trace", default=None, metavar="FILE", help="record every cache operation as a trace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dummy-weights", dest="dummy_weights", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS,
                   help="attention backend (auto: Triton on CUDA, torch-native on the CPU)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="run decode steps eagerly")
    p.add_argument("--overlap", dest="overlap", action="store_true", default=None,
                   help="schedule the next step while the current one runs (default on CUDA)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ENGINE_OPTIONS}


@functools.cache
def _flags() -> dict[str, str]:
    """LLM keyword -> its flag, read off the parser's actions (the first flag of a dest wins)."""
    p = argparse.ArgumentParser(add_help=False)
    add_engine_options(p)
    return {a.dest: a.option_strings[0] for a in reversed(p._actions)}


def option_error(prog: str, err: EngineOptionError) -> int:
    """Print err as one line naming the flag ("kvledger generate: --page-size must be at least 1,
    got 0") on stderr; return the exit status 2. For `validate_engine_options(**engine_kwargs(args))`
    before loading, and for the model-dependent checks that LLM(...) makes once the config is read."""
    print(f"{prog}: {_flags()[err.option]} {err.problem}", file=sys.stderr)
    return 2


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt, streaming to the terminal")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", dest="top_k", type=int, default=-1)
    p.add_argument("--top-p", dest="top_p", type=float, default=1.0)
    p.add_argument("--ignore-eos", dest="ignore_eos", action="store_true")
    add_engine_options(p)
    p.set_defaults(func=generate_command)


def generate_command(args: argparse.Namespace) -> int:
    from kvledger.engine.llm import LLM
    from kvledger.fast import SamplingParams

    try:
        llm = LLM(**engine_kwargs(args))  # checks every option before loading the model
    except EngineOptionError as e:
        return option_error("kvledger generate", e)
    try:
        prompt = llm.chat(args.prompt) if args.chat else args.prompt
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, seed=args.seed)
        for piece in llm.stream(prompt, params):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
    except ValueError as e:
        print(f"kvledger generate: {e}", file=sys.stderr)
        return 2
    finally:
        llm.close()
    if llm.shadow is not None:
        print(f"[verify] {llm.shadow.steps} cache operations mirrored in the reference model: all agreed",
              file=sys.stderr)
    if args.trace:
        print(f"[trace] written to {args.trace} (kvledger replay {args.trace})", file=sys.stderr)
    return 0
