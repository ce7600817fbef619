"""Check the engine options of `LLM(...)` (and of `kvledger generate` / `serve`) before anything loads.

Every bad option raises EngineOptionError naming it, e.g. "page_size must be at least 1, got 0".
"""

from __future__ import annotations

import numbers
import os
from typing import TYPE_CHECKING, Any, Optional, Sequence

from kvledger.engine.model.config import BUILTIN_CONFIG_DIR, ModelConfig
from kvledger.reference.admission_policy import POLICIES

if TYPE_CHECKING:  # engine_config imports this module
    from kvledger.engine.engine_config import EngineConfig

DTYPE_NAMES = ("float32", "bfloat16", "float16")
CACHE_TYPES = ("radix", "naive")
KV_CACHE_DTYPE_NAMES = ("auto", "fp8_e4m3")  # engine/model/kv_pool.py: KV_CACHE_DTYPES
ATTENTION_BACKENDS = ("auto", "torch", "triton")
FP8_DECODE_KERNELS = ("cuda", "triton")  # engine/attention/cuda_fp8_decode.py, triton_decode.py
ADMISSION_POLICIES = POLICIES
# the sampler seeds request uid with seed * 1_000_003 + uid, which torch needs to fit in 64 bits
SEED_LIMIT = 2**32


class EngineOptionError(ValueError):
    """A bad engine option: `option` is its LLM keyword, `problem` what follows it in the message."""

    def __init__(self, option: str, problem: str) -> None:
        super().__init__(f"{option} {problem}")
        self.option = option
        self.problem = problem


def validate_engine_options(c: "EngineConfig") -> None:
    """Raise EngineOptionError for the first bad option of `c` (an EngineConfig), naming it.
    Checks all that needs no model; validate_for_model checks the rest once its config is read."""
    for name in ("verify", "dummy_weights", "cuda_graphs", "cascade_attention"):
        _check_bool(name, getattr(c, name))
    _check_bool("overlap", c.overlap, none_ok=True)
    _check_model(c.model, c.dummy_weights)
    _check_choice("dtype", c.dtype, DTYPE_NAMES)
    _check_device(c.device)
    _check_int("page_size", c.page_size, 1)
    _check_choice("cache_type", c.cache_type, CACHE_TYPES)
    _check_choice("kv_cache_dtype", c.kv_cache_dtype, KV_CACHE_DTYPE_NAMES)
    _check_int(
        "kv_cache_tokens", c.kv_cache_tokens, c.page_size, none_ok=True, least_is=f"one page ({c.page_size} tokens)"
    )
    _check_int("max_running_req", c.max_running_req, 1)
    _check_int("max_seq_len", c.max_seq_len, 2, none_ok=True, least_is="2 (a one-token prompt and one generated token)")
    _check_int("max_prefill_tokens", c.max_prefill_tokens, 1)
    _check_choice("admission", c.admission, ADMISSION_POLICIES)
    _check_ratio("reserve_ratio", c.reserve_ratio)
    _check_trace(c.trace)
    _check_int("seed", c.seed, 0, below=SEED_LIMIT)
    _check_int("threads", c.threads, 1, none_ok=True)
    _check_choice("attention", c.attention, ATTENTION_BACKENDS)
    _check_choice("fp8_decode_kernel", c.fp8_decode_kernel, FP8_DECODE_KERNELS)
    _check_tensor_parallel(c.tensor_parallel_size, c.device)
    _check_faults(c.inject_fault)
    _check_step_timeout(c.step_timeout)


def fault_spec(option: Optional[str]) -> Optional[str]:
    """The fault spec in force: the `inject_fault` option's, else $KVLEDGER_INJECT_FAULT's, else None."""
    from kvledger.engine.runtime.faults import ENV_VAR

    if option is not None and option.strip():
        return option
    return os.environ.get(ENV_VAR, "").strip() or None


def _check_faults(option: Any) -> None:
    if option is not None and not isinstance(option, str):
        raise EngineOptionError("inject_fault", f"must be a fault spec string or None, got {option!r}")
    from kvledger.engine.runtime.faults import ENV_VAR, FaultPlan

    spec = fault_spec(option)
    if spec is None:
        return
    try:
        FaultPlan.parse(spec)
    except ValueError as e:
        where = "" if option is not None and option.strip() else f" (from ${ENV_VAR})"
        raise EngineOptionError("inject_fault", f"is not a valid fault spec{where}: {e}") from None


def _check_step_timeout(value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= float(value) < float("inf"):
        raise EngineOptionError("step_timeout", f"must be a number of seconds >= 0 (0: no watchdog), got {value!r}")


def validate_for_model(max_seq_len: Optional[int], config: ModelConfig, tensor_parallel_size: int = 1) -> None:
    """The options that depend on the model: max_seq_len within its position embeddings, and a
    tensor-parallel size its heads split over."""
    if max_seq_len is not None and max_seq_len > config.max_position_embeddings:
        raise EngineOptionError(
            "max_seq_len",
            f"must be at most the model's max_position_embeddings "
            f"({config.max_position_embeddings}), got {max_seq_len!r}",
        )
    from kvledger.engine.distributed.partition import PartitionError, TensorParallelShard

    try:
        TensorParallelShard(0, tensor_parallel_size).check(config)
    except PartitionError as e:
        raise EngineOptionError("tensor_parallel_size", f"{tensor_parallel_size} does not fit the model: {e}") from None


def _check_ratio(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= float(value) <= 1:
        raise EngineOptionError(name, f"must be a number in [0, 1], got {value!r}")


def _check_int(
    name: str, value: Any, least: int, *, none_ok: bool = False, least_is: str = "", below: Optional[int] = None
) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise EngineOptionError(name, f"must be an integer{' or None' if none_ok else ''}, got {value!r}")
    if int(value) < least:
        raise EngineOptionError(name, f"must be at least {least_is or least}, got {value!r}")
    if below is not None and int(value) >= below:
        raise EngineOptionError(name, f"must be below {below}, got {value!r}")


def _check_bool(name: str, value: Any, *, none_ok: bool = False) -> None:
    if not (isinstance(value, bool) or (none_ok and value is None)):
        raise EngineOptionError(name, f"must be True or False{' or None' if none_ok else ''}, got {value!r}")


def _check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise EngineOptionError(name, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _check_tensor_parallel(size: Any, device: Any) -> None:
    _check_int("tensor_parallel_size", size, 1)
    if size == 1:
        return
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        raise EngineOptionError(
            "tensor_parallel_size", f"{size} needs device 'cuda' (rank r runs on cuda:r), got {device!r}"
        )
    if dev.type == "cuda" and size > torch.cuda.device_count() and "LOCAL_RANK" not in os.environ:
        raise EngineOptionError(
            "tensor_parallel_size", f"{size} needs {size} CUDA devices, {torch.cuda.device_count()} are visible"
        )


def _check_device(device: Any) -> None:
    import torch  # here, not at the top: the CLI parsers import this module

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise EngineOptionError("device", f"must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineOptionError(
            "device", f"is {device!r}, but CUDA is not available (torch.cuda.is_available() is False)"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise EngineOptionError(
            "device", f"is {device!r}, but only {torch.cuda.device_count()} CUDA device(s) are visible"
        )


def _check_model(model: Any, dummy_weights: bool) -> None:
    """None (the embedded model), a .gguf file or a Hugging Face directory; with dummy weights also
    a config .json, a shipped config name or a ModelConfig (see engine.weights.load_weights)."""
    if model is None or (dummy_weights and isinstance(model, ModelConfig)):
        return
    if not isinstance(model, (str, os.PathLike)):
        raise EngineOptionError("model", f"must be a path or None, got {model!r}")
    path = os.fspath(model)
    if dummy_weights and (BUILTIN_CONFIG_DIR / f"{path}.json").is_file():
        return
    if not os.path.exists(path):
        raise EngineOptionError("model", f"{path!r} does not exist")
    if not (os.path.isdir(path) or path.endswith((".gguf", ".json") if dummy_weights else ".gguf")):
        raise EngineOptionError("model", f"must be a .gguf file or a Hugging Face model directory, got {path!r}")


def _check_trace(trace: Any) -> None:
    if trace is None:
        return
    if not isinstance(trace, (str, os.PathLike)):
        raise EngineOptionError("trace", f"must be a file path or None, got {trace!r}")
    path = os.fspath(trace)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise EngineOptionError("trace", f"{path!r} is a directory, not a file")
    if not os.path.isdir(folder):
        raise EngineOptionError("trace", f"{path!r}: directory {folder!r} does not exist")
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        raise EngineOptionError("trace", f"{path!r} is not writable")
