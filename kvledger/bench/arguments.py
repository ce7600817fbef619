"""Every benchmark's command-line options, in one light module: `kvledger --help` builds its parser
without importing torch or the benchmarks themselves."""

from __future__ import annotations

import argparse
import math

from kvledger.engine.engine_config import EngineConfig

BENCH_DTYPES = ("bfloat16", "float32")
WORKLOAD = "nano-vllm"
EARLY_STOP = "early-stop"
SHARED_PREFIX = "shared-prefix"
WORKLOADS = (WORKLOAD, EARLY_STOP, SHARED_PREFIX)
NANO_NUM_REQUESTS = 256
NANO_MIN_LEN = 100
NANO_MAX_LEN = 1024
NANO_ENGINE_OPTIONS = ("page_size", "kv_cache_dtype", "kv_cache_tokens", "max_running_reqs", "max_prefill_tokens", "cuda_graphs",
                       "overlap", "attention")
EARLY_STOP_RATIOS = "0.5,0.1"


class _Given(argparse.Action):
    """Store the value and note the option as given (in `namespace.given`): `--workload early-stop`
    picks its own, device-dependent defaults for the shared options left out."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, "given", frozenset(getattr(namespace, "given", frozenset())) | {self.dest})


def add_bench_arguments(parser) -> None:
    parser.add_argument("--prompts", type=int, default=32, help="number of requests")
    parser.add_argument("--min-len", type=int, default=32, help="shortest prompt, tokens")
    parser.add_argument("--max-len", type=int, default=256, help="longest prompt, tokens")
    parser.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--dtype", default=None, choices=list(BENCH_DTYPES),
                        help="weights and activations (default: float32; with --workload nano-vllm: bfloat16 on "
                             "CUDA, float32 on CPU)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts (and of random weights)")
    parser.add_argument("--skip-transformers", action="store_true", help="run this engine only")
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded model; "
                        "with --workload nano-vllm: real weights instead of --model-config's random ones)")


def add_nano_bench_arguments(p) -> None:
    """Options of `kvledger bench --workload nano-vllm`. --dtype, --seed, --threads and --model come from
    add_bench_arguments, -o/--output from add_online_bench_arguments."""
    p.set_defaults(given=frozenset())
    g = p.add_argument_group("--workload nano-vllm (GPU throughput benchmark)")
    g.add_argument("--workload", default=None, choices=list(WORKLOADS),
                   help="nano-vllm: its offline workload (256 requests, 142,827 in / 133,966 out tokens); "
                        "early-stop: outputs end before max_tokens, unknown to the scheduler (reserve vs "
                        "optimistic admission); shared-prefix: groups of requests sharing a long prefix, radix vs "
                        "naive cache")
    g.add_argument("--num-requests", dest="num_requests", type=int, default=NANO_NUM_REQUESTS, action=_Given,
                   help="requests in the workload (its first N; early-stop: 256 on CUDA, 24 on the CPU)")
    g.add_argument("--max-input-len", dest="max_input_len", type=int, default=NANO_MAX_LEN, action=_Given,
                   help="longest prompt (shortest: 100/1024 of it; early-stop: 1024 on CUDA, 128 on the CPU)")
    g.add_argument("--max-output-len", dest="max_output_len", type=int, default=NANO_MAX_LEN,
                   help="largest max_tokens (smallest: 100/1024 of it)")
    g.add_argument("--model-config", dest="model_config", default="qwen3-0.6b", action=_Given,
                   help="shipped config (qwen3-0.6b, smollm2-135m) or a config.json, random weights (early-stop "
                        "on the CPU without it: the embedded model)")
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    g.add_argument("--tp", "--tensor-parallel-size", dest="tensor_parallel_sizes", default="1", metavar="N[,N...]",
                   help="tensor-parallel sizes, comma-separated: each runs the workload in turn (1,2: TP=1 then "
                        "TP=2 in one run, with their ratio and each one's profile, all-reduce time included)")
    g.add_argument("--compare", default="none", choices=["none", "transformers"],
                   help="also run transformers' continuous batching")
    g.add_argument("--hf-attn", dest="hf_attn", default="sdpa",
                   help="transformers attn_implementation (continuous batching may switch sdpa to flash)")
    g.add_argument("--hf-max-batch-tokens", dest="hf_max_batch_tokens", type=int, default=None,
                   help="transformers' max_batch_tokens (default: its own on CUDA, 2048 on CPU)")
    g.add_argument("--bandwidth-bytes", dest="bandwidth_bytes", type=int, default=None,
                   help="bytes copied to measure bandwidth (default 2 GiB on CUDA, 64 MiB on CPU)")
    g.add_argument("--bandwidth-gbs", dest="bandwidth_gbs", type=float, default=None,
                   help="use this bandwidth (GB/s) for the floor instead of measuring")
    g.add_argument("--profile-requests", dest="profile_requests", type=int, default=256,
                   help="requests in the profiled decode batch, the workload's first prompts (0: no profile)")
    g.add_argument("--profile-output-len", dest="profile_output_len", type=int, default=32,
                   help="tokens each profiled request generates")
    # the engine's own options, from its one config (with this workload's defaults)
    EngineConfig.add_arguments(p, only=NANO_ENGINE_OPTIONS, title="--workload nano-vllm: engine options",
                               defaults={"max_running_reqs": 256, "max_prefill_tokens": 16384, "cuda_graphs": None},
                               helps={"kv_cache_tokens": "KV pool size in tokens (default: from free GPU memory where "
                                                         "the engine can, else the workload's need; early-stop: "
                                                         "ceil(min(max_running_reqs, requests) / 8) worst cases, "
                                                         "the longest prompt plus max_tokens each)"})
    g = p.add_argument_group("--workload early-stop (reserve vs optimistic admission; also --num-requests, "
                             "--max-input-len, --model-config, --device and the engine options above)")
    g.add_argument("--max-tokens", dest="max_tokens", type=int, default=None,
                   help="max_tokens of every request, all the scheduler knows (default: 2048 on CUDA, 256 on the CPU)")
    g.add_argument("--output-median", dest="output_median", type=float, default=None,
                   help="median of the lognormal output lengths, tokens (default: max_tokens * 200 / 2048)")
    g.add_argument("--output-sigma", dest="output_sigma", type=float, default=1.0,
                   help="sigma of the lognormal output lengths (the tail); lengths are capped at max_tokens")
    g.add_argument("--policies", default="reserve,optimistic",
                   help="admission policies, comma-separated: reserve runs first (always), each other policy once "
                        "per --ratios entry")
    g.add_argument("--ratios", default=EARLY_STOP_RATIOS,
                   help="reserve ratios of the preempting policies, comma-separated")
    g = p.add_argument_group("--workload shared-prefix (SGLang's generated-shared-prefix style; also --model-config, "
                             "--device, --dtype, --seed and the engine options above)")
    g.add_argument("--groups", type=int, default=32, help="groups of requests, one shared prefix each")
    g.add_argument("--group-size", dest="group_size", type=int, default=16, help="requests per group")
    g.add_argument("--prefix-len", dest="prefix_len", type=int, default=2048, help="tokens of each group's prefix")
    g.add_argument("--question-len", dest="question_len", type=int, default=256,
                   help="tokens each request adds after its group's prefix")
    g.add_argument("--answer-len", dest="answer_len", type=int, default=256, help="tokens each request generates")
    g.add_argument("--caches", default="radix,naive", help="caches to run in turn, comma-separated: radix (with "
                   "cascade decode attention), radix-flat (radix without it), naive")


def add_online_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The options `kvledger bench` lacks; it already has --prompts, --min-len, --max-len,
    --output-len and --seed, which the online benchmark shares."""
    p.add_argument("--serve", metavar="URL", default=None,
                   help="benchmark a running server at URL (e.g. http://127.0.0.1:8000) instead of offline")
    p.add_argument("--request-rate", dest="request_rate", type=float, default=math.inf,
                   help="Poisson arrival rate in requests/s (default inf: all at once)")
    p.add_argument("--max-concurrency", dest="max_concurrency", type=int, default=None,
                   help="at most this many requests in flight (default: no limit)")
    p.add_argument("--shared-prefix-len", dest="shared_prefix_len", type=int, default=0,
                   help="tokens of prefix shared within each group of prompts")
    p.add_argument("--prefix-groups", dest="prefix_groups", type=int, default=1, help="number of shared prefixes")
    p.add_argument("--api-key", dest="api_key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--served-model", dest="served_model", default=None, help="model id (default: the server's)")
    p.add_argument("-o", "--output", dest="output", default=None, metavar="FILE.json",
                   help="with --serve or --workload: also write the figures as JSON (nano-vllm: every raw number)")
    p.add_argument("--no-progress", dest="no_progress", action="store_true", help="--serve: no progress bar")
