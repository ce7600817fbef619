"""One frozen engine configuration: every option of `LLM`, `kvledger generate` and `kvledger serve`,
with its default and its help. The command-line flags are generated from it, so an option is
declared once; creating an EngineConfig checks every value (`engine/options.py` has the rules)."""

from __future__ import annotations

import argparse
import warnings
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Dict, Optional, Sequence

from kvledger.engine.ledger.trace import Header
from kvledger.engine.options import (
    ADMISSION_POLICIES,
    ATTENTION_BACKENDS,
    CACHE_TYPES,
    DTYPE_NAMES,
    FP8_DECODE_KERNELS,
    KV_CACHE_DTYPE_NAMES,
    EngineOptionError,
    fault_spec,
    validate_engine_options,
)
from kvledger.reference.admission_policy import AdmissionPolicy


def option(
    default: Any,
    help: str,
    *,
    flag: Optional[str] = None,
    choices: Optional[Sequence[str]] = None,
    negative: Optional[str] = None,
    metavar: Optional[str] = None,
    alias: Optional[str] = None,
    renamed: Optional[str] = None,
) -> Any:
    """A config field with what its flag needs. `negative`: the flag that sets a boolean False;
    `alias`: a second, short flag; `renamed`: the option's former name, whose flag and keyword are
    still accepted with a warning."""
    meta = {
        "help": help,
        "flag": flag,
        "choices": choices,
        "negative": negative,
        "metavar": metavar,
        "alias": alias,
        "renamed": renamed,
    }
    return field(default=default, metadata=meta)


class _RenamedFlag(argparse.Action):
    """A flag's former name: it sets the option, with a warning that names the new flag."""

    def __init__(self, *args: Any, new_flag: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.new_flag = new_flag

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: Optional[str] = None,
    ) -> None:
        warnings.warn(f"{option_string} is deprecated: use {self.new_flag}", FutureWarning, stacklevel=2)
        setattr(namespace, self.dest, values)


@dataclass(frozen=True)
class EngineConfig:
    model: Any = option(
        None,
        "a .gguf file or a Hugging Face directory (default: the embedded "
        "SmolLM2-135M-Instruct); with --dummy-weights also a shipped config name",
    )
    dtype: str = option("float32", "weights, activations and KV cache dtype", choices=DTYPE_NAMES)
    device: str = option("cpu", "cpu, cuda or cuda:N")
    page_size: int = option(16, "tokens per KV page")
    cache_type: str = option("radix", "prefix cache", flag="--cache", choices=CACHE_TYPES)
    kv_cache_dtype: str = option(
        "auto",
        "KV cache storage: auto (the model dtype) or fp8_e4m3 (half of bf16's "
        "bytes; stored as x / scale, one scale for K and one for V per layer)",
        choices=KV_CACHE_DTYPE_NAMES,
    )
    kv_cache_tokens: Optional[int] = option(
        None,
        "KV pool size in tokens, rounded down to whole pages (default: "
        "32768 on the CPU or with --verify, from free memory on CUDA)",
    )
    # mini-sglang's name for it (its LLM's and ServerArgs' max_running_req)
    max_running_req: int = option(64, "requests decoding at once (page-table rows)", renamed="max_running_reqs")
    max_seq_len: Optional[int] = option(
        None, "prompt plus generated tokens per request (default: the model's context, at most 4096)"
    )
    max_prefill_tokens: int = option(2048, "tokens one prefill step computes; longer prompts are chunked")
    admission: str = option(
        "reserve",
        "admission policy: reserve each request's worst case (never preempts); "
        "optimistic: reserve part of max_tokens, preempt the newest request when "
        "KV runs short; adaptive: optimistic, the part learned from the output "
        "lengths of requests that ended",
        choices=ADMISSION_POLICIES,
    )
    reserve_ratio: float = option(
        0.5,
        "optimistic: the fraction of a request's remaining max_tokens reserved at "
        "admission (adaptive: until 8 requests have ended)",
    )
    verify: bool = option(False, "shadow every cache operation in the reference model and compare")
    trace: Optional[str] = option(None, "record every cache operation to this trace file", metavar="FILE")
    seed: int = option(0, "base seed of sampling and of dummy weights")
    dummy_weights: bool = option(False, "random weights in the model's shapes instead of loading them")
    threads: Optional[int] = option(None, "torch CPU threads (default: torch's choice)")
    attention: str = option(
        "auto", "attention backend (auto: Triton on CUDA, torch-native on the CPU)", choices=ATTENTION_BACKENDS
    )
    fp8_decode_kernel: str = option(
        "cuda",
        "Triton attention over an FP8 KV cache: decode in the CUDA C++ kernel (compiled by NVRTC at "
        "start; the Triton kernel where it cannot run) or in the Triton kernel",
        choices=FP8_DECODE_KERNELS,
    )
    cuda_graphs: bool = option(True, "capture decode steps as CUDA graphs", negative="--no-cuda-graphs")
    cascade_attention: bool = option(
        True,
        "Triton decode with the radix cache: read a prefix that running requests "
        "share once per group, not once per request",
        negative="--no-cascade-attention",
    )
    tensor_parallel_size: int = option(
        1,
        "processes (one per GPU, or CPU processes over gloo) that split the model "
        "by heads and MLP features; each holds its share of the KV pool",
        flag="--tensor-parallel-size",
        alias="--tp",
    )
    overlap: Optional[bool] = option(
        None, "schedule the next step while the current one runs (default: on for CUDA)", negative="--no-overlap"
    )
    inject_fault: Optional[str] = option(
        None,
        "inject faults to rehearse them: KIND@step=N[,request=UID][,seed=S][,times=K][,seconds=T][,rank=R], "
        "several separated by ';' (kinds: forward-raise, alloc-refuse, step-stall, cuda-poison, rank-kill, "
        "rank-stop; engine/runtime/faults.py); default: $KVLEDGER_INJECT_FAULT, else none",
        metavar="SPEC",
    )
    step_timeout: Optional[float] = option(
        60.0,
        "the server's watchdog: a step running longer than this many seconds declares the engine stalled "
        "(its batch and ledger are logged, open requests fail, the server exits 1); 0 turns it off",
        metavar="SECONDS",
    )

    def __post_init__(self) -> None:
        validate_engine_options(self)

    @classmethod
    def create(cls, **options: Any) -> EngineConfig:
        """EngineConfig(**options), with an unknown option named like a bad value."""
        known = {f.name for f in fields(cls)}
        for f in fields(cls):
            old = f.metadata["renamed"]
            if old is not None and old in options:
                warnings.warn(f"engine option {old} is deprecated: use {f.name}", FutureWarning, stacklevel=2)
                options[f.name] = options.pop(old)
        for name in options:
            if name not in known:
                raise EngineOptionError(name, f"is not an engine option (known: {', '.join(sorted(known))})")
        return cls(**options)

    def as_dict(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # -- the command line -----------------------------------------------------------------------
    @classmethod
    def flag(cls, name: str) -> str:
        """The flag that sets option `name`: --page-size, --cache, ..."""
        meta = next(f.metadata for f in fields(cls) if f.name == name)
        return meta["flag"] or "--" + name.replace("_", "-")

    @classmethod
    def add_arguments(
        cls,
        parser: argparse.ArgumentParser,
        *,
        only: Optional[Sequence[str]] = None,
        defaults: Optional[Dict[str, Any]] = None,
        helps: Optional[Dict[str, str]] = None,
        title: str = "engine options",
    ) -> None:
        """Add the options' flags to `parser` (all of them, or those named in `only`), with their
        help; `defaults` and `helps` override a default and its help (a benchmark's own workload)."""
        group = parser.add_argument_group(title)
        defaults = defaults or {}
        for f in fields(cls):
            if only is not None and f.name not in only:
                continue
            meta = f.metadata
            default = defaults.get(f.name, f.default if f.default is not MISSING else None)
            flag, shown = cls.flag(f.name), (helps or {}).get(f.name, meta["help"])  # the formatter adds the default
            if "bool" in f.type:
                if default is not True:  # a True default has only its negative flag: --no-cuda-graphs
                    group.add_argument(flag, dest=f.name, action="store_true", default=default, help=shown)
                if meta["negative"]:
                    group.add_argument(
                        meta["negative"],
                        dest=f.name,
                        action="store_false",
                        default=default,
                        help=f"do not {meta['help']}",
                    )
                continue
            kind = float if "float" in f.type else int if "int" in f.type else str
            flags = (flag, meta["alias"]) if meta["alias"] else (flag,)
            group.add_argument(
                *flags,
                dest=f.name,
                type=kind,
                default=default,
                choices=meta["choices"],
                metavar=meta["metavar"],
                help=shown,
            )
            if meta["renamed"]:
                group.add_argument(
                    "--" + meta["renamed"].replace("_", "-"),
                    dest=f.name,
                    type=kind,
                    default=argparse.SUPPRESS,
                    action=_RenamedFlag,
                    new_flag=flag,
                    help=argparse.SUPPRESS,
                )

    def resolve(self, num_pages: int, max_seq_len: int) -> ResolvedConfig:
        """This configuration for one engine whose pool holds `num_pages` pages and whose requests
        may span `max_seq_len` positions (see `engine/runtime/build.py`)."""
        return ResolvedConfig(
            num_pages=num_pages,
            page_size=self.page_size,
            cache_type=self.cache_type,
            max_running_req=self.max_running_req,
            max_seq_len=max_seq_len,
            max_prefill_tokens=self.max_prefill_tokens,
            seed=self.seed,
            admission=AdmissionPolicy(self.admission, self.reserve_ratio),
            inject_fault=fault_spec(self.inject_fault),
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class ResolvedConfig:
    """An EngineConfig resolved for one built engine: the pool in pages (from free memory when
    `kv_cache_tokens` is not given) and max_seq_len (from the model's context when not given).
    The engine, its cache scheduler and the trace header are all built from this one object."""

    num_pages: int
    page_size: int
    cache_type: str
    max_running_req: int
    max_seq_len: int
    max_prefill_tokens: int
    seed: int
    admission: AdmissionPolicy
    inject_fault: Optional[str] = None  # the fault spec in force (the option's, else the environment's)

    @property
    def pool_tokens(self) -> int:
        return self.num_pages * self.page_size

    def trace_header(self, producer: str = "engine") -> Header:
        """The header of a trace this engine records; `Header.cache_scheduler_args` builds the
        cache scheduler from it, so the engine and a replay of its trace start alike."""
        return Header(
            num_pages=self.num_pages,
            page_size=self.page_size,
            cache_type=self.cache_type,
            table_slots=self.max_running_req,  # the trace's name for it
            max_seq_len=self.max_seq_len,
            admission=self.admission.kind,
            reserve_ratio=self.admission.reserve_ratio,
            seed=self.seed,
            producer=producer,
        )
