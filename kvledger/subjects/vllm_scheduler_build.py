"""Build vLLM 0.33.0's real `Scheduler` (or `AsyncScheduler`) for a kvledger `SubjectConfig`.

The scheduler needs a `VllmConfig`, whose `ModelConfig` inspects a model architecture by
importing its module (~11 s here; a speculative EAGLE config inspects a draft model as well, as
long again). No weights are read: the model directory is a generated `config.json` (a tiny
Llama) in a cache directory. So the expensive parts are built once per process and shape and
copied per subject (`_model_config`, `_speculative_config`); a subject then costs milliseconds.

What the builder maps (see `/work/shared/notes/field-paths.md` sections 0-2):
  SubjectConfig.num_pages        usable blocks; the pool has one more, the null block 0
  SubjectConfig.page_size        block_size (every group's, the scheduler's and the hash's)
  SubjectConfig.max_seq_len      max_model_len
  SubjectConfig.max_running_req  max_num_seqs
  max_num_batched_tokens         large: the driver passes each step's budget instead

Options for the paths past the plain one: `groups` (one `Group` per KV cache group: full
attention, or a sliding window W: vLLM's hybrid coordinator when there are several),
`speculative` (ngram or EAGLE-style drafts, K tokens), `kv_transfer` (a `KVTransferConfig`'s
keyword arguments: the connector's scheduler side), `async_scheduling` (an `AsyncScheduler`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from kvledger.properties.subject import SubjectConfig

# The generated model: small enough to construct in no time, large enough for any trace's
# max_seq_len (max_position_embeddings caps max_model_len)
_MODEL: Dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 1 << 16,
    "torch_dtype": "float16",
}
_MAX_BATCHED_TOKENS = 1 << 16  # the scheduler's own cap; each step's budget comes from the driver


@dataclass(frozen=True)
class Group:
    """One KV cache group: full attention, a sliding window of `window` tokens, or chunked local
    attention in chunks of `chunk` tokens."""

    window: Optional[int] = None
    chunk: Optional[int] = None


FULL = Group()


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding: `method` "ngram" (no lookahead slots) or "eagle" (the draft model's
    `num_lookahead_tokens` = K slots past the verified tokens), K = `tokens` drafts per step."""

    method: str = "ngram"
    tokens: int = 3


@dataclass
class Built:
    """A scheduler and the configs it was built from."""

    scheduler: Any  # vllm.v1.core.sched.scheduler.Scheduler (or AsyncScheduler)
    vllm_config: Any
    kv_cache_config: Any


def model_dir() -> Path:
    """The generated model directory (a config.json only), shared by every process of this user."""
    text = json.dumps(_MODEL, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"kvledger-vllm-model-{os.getuid()}-{digest}"
    config = path / "config.json"
    if not config.exists():
        path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, config)
    return path


def import_vllm() -> None:
    # vLLM infers its platform on first use; without this VllmConfig raises "Failed to infer
    # device type" on a machine with no accelerator. Set before the first vllm import.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # vLLM's config warnings (CPU block sizes, batched tokens past max_num_seqs * max_model_len)
    # are about a deployment's speed, and every subject built repeats them: only its errors reach
    # kvledger's log, unless kvledger logs at debug
    if not logging.getLogger("kvledger").isEnabledFor(logging.DEBUG):
        logging.getLogger("vllm").setLevel(logging.ERROR)


_CACHE: Dict[Tuple[Any, ...], Any] = {}  # the expensive configs, once per process


def _model_config() -> Any:
    """The ModelConfig (architecture inspection, ~11 s), once per process; copied per subject."""
    if ("model",) not in _CACHE:
        import_vllm()
        from vllm.config import ModelConfig

        d = str(model_dir())
        _CACHE[("model",)] = ModelConfig(
            model=d,
            tokenizer=d,
            skip_tokenizer_init=True,
            max_model_len=_MODEL["max_position_embeddings"],
            dtype="float16",
            seed=0,
        )
    return _CACHE[("model",)]


def _speculative_config(spec: Speculation) -> Any:
    key = ("spec", spec)
    if key not in _CACHE:
        from vllm.config import ParallelConfig, SpeculativeConfig

        target = _model_config()
        if spec.method == "ngram":
            made = SpeculativeConfig(
                method="ngram",
                num_speculative_tokens=spec.tokens,
                prompt_lookup_max=spec.tokens,
                prompt_lookup_min=1,
                target_model_config=target,
                target_parallel_config=ParallelConfig(),
            )
        elif spec.method == "eagle":
            # the draft "model" is the same generated config: EAGLE's scheduler side only needs
            # num_lookahead_tokens = K; use_eagle_block_drop comes out False for a plain config
            made = SpeculativeConfig(
                method="eagle",
                model=str(model_dir()),
                num_speculative_tokens=spec.tokens,
                target_model_config=target,
                target_parallel_config=ParallelConfig(),
            )
        else:
            raise ValueError(f"speculation method {spec.method!r}: ngram or eagle")
        _CACHE[key] = made
    return _CACHE[key]


def _kv_cache_config(config: SubjectConfig, groups: Sequence[Group]) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    bs = config.page_size
    specs = []
    for i, group in enumerate(groups):
        # the attention shape only sizes KV tensors the scheduler never allocates
        shape: Dict[str, Any] = dict(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float16)
        if group.chunk is not None:
            kv_spec: Any = ChunkedLocalAttentionSpec(**shape, attention_chunk_size=group.chunk)
        elif group.window is not None:
            kv_spec = SlidingWindowSpec(**shape, sliding_window=group.window)
        else:
            kv_spec = FullAttentionSpec(**shape)
        specs.append(KVCacheGroupSpec([f"layer.{i}"], kv_spec))
    return KVCacheConfig(num_blocks=config.num_pages + 1, kv_cache_tensors=[], kv_cache_groups=specs)


def build_scheduler(
    config: SubjectConfig,
    *,
    groups: Sequence[Group] = (FULL,),
    speculative: Optional[Speculation] = None,
    kv_transfer: Optional[Mapping[str, Any]] = None,
    async_scheduling: bool = False,
) -> Built:
    """A fresh real Scheduler (AsyncScheduler with `async_scheduling`) over a pool of
    `config.num_pages` usable blocks. `kv_transfer`: KVTransferConfig's keyword arguments
    (e.g. {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_connector_extra_config":
    {...}}); the scheduler builds the connector's scheduler side from it."""
    import_vllm()
    from vllm.config import CacheConfig, KVTransferConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    if not groups:
        raise ValueError("build_scheduler: at least one KV cache group")
    bs = config.page_size
    model = copy.deepcopy(_model_config())
    model.max_model_len = config.max_seq_len
    cache = CacheConfig(block_size=bs, enable_prefix_caching=True)
    cache.num_gpu_blocks = config.num_pages + 1  # Scheduler.__init__ asserts it is set
    sched = SchedulerConfig(
        max_num_seqs=config.max_running_req,
        max_num_batched_tokens=_MAX_BATCHED_TOKENS,
        max_model_len=config.max_seq_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    extra: Dict[str, Any] = {}
    if speculative is not None:
        extra["speculative_config"] = copy.deepcopy(_speculative_config(speculative))
    if kv_transfer is not None:
        extra["kv_transfer_config"] = KVTransferConfig(**dict(kv_transfer))
    vllm_config = VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched, **extra)
    if async_scheduling:
        # the CPU platform turns async scheduling off in VllmConfig (platforms/cpu.py); the
        # scheduler itself runs on any platform, so it is switched back on for it alone
        vllm_config.scheduler_config.async_scheduling = True
    kv_cache_config = _kv_cache_config(config, groups)
    cls = AsyncScheduler if async_scheduling else Scheduler
    scheduler = cls(
        vllm_config,
        kv_cache_config,
        StructuredOutputManager(vllm_config),
        block_size=bs,
        log_stats=False,
    )
    return Built(scheduler, vllm_config, kv_cache_config)
