"""Importing SGLang's KV cache the way the sglang subject does: the packages it needs, where its
JIT caches go, the torchvision stand-in and the environment put back after, and the names the
adapter calls, imported once per process (`PACKAGE.load()` -> `SglangNames`)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, Dict, Iterator, Tuple

from kvledger.subjects.installed import InstalledPackage

log = logging.getLogger(__name__)

VERSION = "0.5.23"  # the version the zoo's edit texts are written against
# What importing the cache's modules needs on top of the project's environment; the exact pins
# are in the `# sglang` section of subjects-constraints.txt. Never without --no-deps: sglang pins
# a CUDA build of torch (and torchvision, which its import chain reaches: see _torchvision_stand_in).
PACKAGES: Tuple[str, ...] = (
    "sglang",
    "apache-tvm-ffi",
    "compressed-tensors",
    "dill",
    "ipython",
    "loguru",
    "msgspec",
    "orjson",
    "partial-json-parser",
    "pybase64",
    "pyzmq",
    "sentencepiece",
    "traitlets",
    "triton",
)
INSTALL = f"pip install --no-deps -c subjects-constraints.txt {' '.join(PACKAGES)}"
_MODULES: Tuple[str, ...] = (
    "sglang",
    "tvm_ffi",
    "compressed_tensors",
    "dill",
    "IPython",
    "loguru",
    "msgspec",
    "orjson",
    "partial_json_parser",
    "pybase64",
    "zmq",
    "sentencepiece",
    "traitlets",
    "triton",
)

# SGLang's modules that hold what the adapter calls and what the zoo edits
RADIX_CACHE = "sglang.srt.mem_cache.radix_cache"
UNIFIED = "sglang.srt.mem_cache.unified_radix_cache"
TREE_CORE = "sglang.srt.mem_cache.unified_cache.unified_tree_core"
FULL_COMPONENT = "sglang.srt.mem_cache.unified_cache.components.full"
PAGED = "sglang.srt.mem_cache.allocator.paged"
COMMON = "sglang.srt.mem_cache.common"
ALLOCATION = "sglang.srt.mem_cache.allocation"
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch"


def _cache_root() -> Path:
    base = os.environ.get("KVLEDGER_CACHE")
    if base:
        return Path(base) / "sglang"
    return Path(tempfile.gettempdir()) / f"kvledger-sglang-{os.getuid()}"


@contextlib.contextmanager
def _torchvision_stand_in() -> Iterator[None]:
    """`memory_pool` imports `sglang.srt.configs`, whose `__init__` imports every model config;
    `configs/nano_nemotron_vl.py` imports `multimodal/internvl_utils.py`, which imports
    `torchvision.transforms` (and `InterpolationMode`) at module level for its image preprocessing,
    which the cache never runs. PyPI's torchvision is a CUDA build that does not load on the CPU
    torch (`operator torchvision::nms does not exist`), so where torchvision is absent, inert stand-ins
    for exactly those three modules sit in sys.modules while the cache's modules import, and are
    taken out after: nothing else in the process ever sees a torchvision."""
    if importlib.util.find_spec("torchvision") is not None:
        yield
        return

    class _Unavailable:
        def __getattr__(self, name: str) -> Any:
            raise ImportError(
                "torchvision is not installed (kvledger stood in for it while importing sglang's "
                "KV cache, which never uses it)"
            )

    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    stand_ins: Dict[str, Any] = {}
    for name in names:
        module = types.ModuleType(name, "kvledger's stand-in: sglang's cache imports it, never uses it")
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=name != names[-1])
        module.__path__ = []
        stand_ins[name] = module
    stand_ins["torchvision"].transforms = stand_ins["torchvision.transforms"]
    stand_ins["torchvision.transforms"].functional = stand_ins["torchvision.transforms.functional"]
    for name in names[1:]:
        stand_ins[name].InterpolationMode = _Unavailable()
    sys.modules.update(stand_ins)
    try:
        yield
    finally:
        for name in names:
            if sys.modules.get(name) is stand_ins[name]:
                del sys.modules[name]


@contextlib.contextmanager
def _own_environment(keep: Path) -> Iterator[None]:
    """sglang's import sets a dozen variables process-wide (`sglang/srt/environ.py` and its
    callers: TORCHINDUCTOR_COMPILE_THREADS, PYTORCH_NVML_BASED_CUDA_CHECK, TLLM_LOG_LEVEL, cache
    paths, ...). The cache paths under `keep` stay (they keep JIT caches out of ~/.cache); the rest
    are put back as they were, so the rest of the process runs as without sglang."""
    before = dict(os.environ)
    try:
        yield
    finally:
        changed = {k: v for k, v in os.environ.items() if before.get(k) != v}
        for key, value in changed.items():
            if value.startswith(str(keep)):
                continue
            if key in before:
                os.environ[key] = before[key]
            else:
                del os.environ[key]
        log.debug("sglang: its import set %s", sorted(changed))


class SglangNames:
    """The SGLang names the adapter uses, imported once per process."""

    def __init__(self) -> None:
        root = _cache_root()
        # read at import time (sglang/srt/environ.py; tvm_ffi's JIT cache): set them first
        os.environ.setdefault("SGLANG_CACHE_DIR", str(root / "cache"))
        os.environ.setdefault("TVM_FFI_CACHE_DIR", str(root / "tvm-ffi"))
        import torch
        import transformers  # noqa: F401  (its torchvision probe runs before the stand-in exists)

        with _own_environment(root), _torchvision_stand_in():
            from sglang.srt.environ import envs
            from sglang.srt.managers import schedule_batch, schedule_policy
            from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker
            from sglang.srt.mem_cache import allocation, common, memory_pool, radix_cache, unified_radix_cache
            from sglang.srt.mem_cache.allocator import (
                BaseTokenToKVPoolAllocator,
                PagedTokenToKVPoolAllocator,
                TokenToKVPoolAllocator,
            )
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams
            from sglang.srt.mem_cache.cache_init_params import CacheInitParams
            from sglang.srt.mem_cache.unified_cache.components import ComponentType
            from sglang.srt.runtime_context import publish, publish_role
            from sglang.srt.sampling.sampling_params import SamplingParams
            from sglang.srt.server_args import ServerArgs
            from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
            from sglang.srt.utils import get_num_new_pages

        self.torch = torch
        self.schedule_batch = schedule_batch
        self.Req = schedule_batch.Req
        self.ScheduleBatch = schedule_batch.ScheduleBatch
        self.FINISH_ABORT = schedule_batch.FINISH_ABORT
        self.FINISH_MATCHED_TOKEN = schedule_batch.FINISH_MATCHED_TOKEN
        self.CLIP_MAX_NEW_TOKENS = schedule_policy.CLIP_MAX_NEW_TOKENS
        self.NewTokenRatioTracker = NewTokenRatioTracker
        self.allocation = allocation
        self.common = common
        self.ReqToTokenPool = memory_pool.ReqToTokenPool
        self.RadixCache = radix_cache.RadixCache
        self.UnifiedRadixCache = unified_radix_cache.UnifiedRadixCache
        self.ComponentType = ComponentType
        self.PagedTokenToKVPoolAllocator = PagedTokenToKVPoolAllocator
        self.TokenToKVPoolAllocator = TokenToKVPoolAllocator
        self.BaseTokenToKVPoolAllocator = BaseTokenToKVPoolAllocator
        self.EvictParams = EvictParams
        self.CacheInitParams = CacheInitParams
        self.SamplingParams = SamplingParams
        self.NONE = SpeculativeAlgorithm.NONE
        self.get_num_new_pages = get_num_new_pages
        self.envs = envs
        # Req, the allocation functions and the ratio tracker read the process-wide config a
        # scheduler process publishes at start (runtime_context.publish); the defaults of a plain
        # text model on CPU. Someone else's published config is left alone.
        if publish_role() is None:
            publish(ServerArgs(model_path="dummy", device="cpu"), role="scheduler")


PACKAGE = InstalledPackage("sglang", VERSION, _MODULES, INSTALL, SglangNames)
