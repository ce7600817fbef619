"""`kvledger generate`: stream a completion of one prompt to the terminal."""

from __future__ import annotations

import argparse
import logging
import sys

from kvledger.cli.parser import option_error
from kvledger.engine.engine_config import EngineConfig

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt, streaming to the terminal")
    p.add_argument("prompt", help="the text to continue (or, with --chat, the user's message)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-k", dest="top_k", type=int, default=-1, help="sample from the k most likely tokens (-1: all)")
    p.add_argument("--top-p", dest="top_p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--ignore-eos", dest="ignore_eos", action="store_true", help="keep generating past end-of-sequence")
    EngineConfig.add_arguments(p)
    p.set_defaults(func=generate_command)


def generate_command(args: argparse.Namespace) -> int:
    from kvledger.engine.options import EngineOptionError
    from kvledger.engine.runtime.llm import LLM
    from kvledger.fast import SamplingParams

    try:
        llm = LLM(engine_config=EngineConfig.from_args(args))  # checks every option before loading the model
    except EngineOptionError as e:
        return option_error("kvledger generate", e)
    try:
        prompt = llm.chat(args.prompt) if args.chat else args.prompt
        params = SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
            ignore_eos=args.ignore_eos,
            seed=args.seed,
        )
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
        log.info("[verify] %d cache operations mirrored in the reference model: all agreed", llm.shadow.steps)
    if args.trace:
        log.info("[trace] written to %s (kvledger replay %s)", args.trace, args.trace)
    return 0
