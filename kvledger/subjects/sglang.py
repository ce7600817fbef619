"""SGLang's radix cache and paged KV allocator (the installed sglang 0.5.23) as a kvledger subject.

One `RadixCache` over a `PagedTokenToKVPoolAllocator` (`TokenToKVPoolAllocator` at page size 1,
as `kv_cache_configurator.py` picks) and a `ReqToTokenPool`, driven with real
`sglang.srt.managers.schedule_batch.Req` objects through SGLang's own scheduler functions:
`Req.init_next_round_input` (match), the `PrefillAdder` arithmetic (`managers/schedule_policy.py`,
`add_one_req` over `mem_cache/prefill_budget.py:PrefillBudget`), `alloc_for_extend` /
`alloc_for_decode` (`mem_cache/allocation.py`, on a one-request `ScheduleBatch`),
`checkpoint_kv_cache` / `release_kv_cache` (`mem_cache/common.py`). No model, no GPU, no
scheduler process. (SGLang's scheduler builds a `UnifiedRadixCache` by default in this version,
`mem_cache/registry.py:default_radix_cache_factory`; this subject is the classic `RadixCache`,
which `PureSWARadixCache` and FlexKV build on and which shares the checkpoint/release path.)

What SGLang does that the driver must know (the capabilities):
- page 0 is the padding page the allocator never hands out, and `size` excludes it: the free
  list starts as pages 1..size // page_size (`PagedTokenToKVPoolAllocator.clear`), so the pool is
  built with `size = num_pages * page_size` and the pages are 1..num_pages;
- admission is not a worst-case promise (`worst_case_admission=False`, `preempts=True`): the
  `PrefillAdder` admits a request when its remaining prompt + max_new_tokens + a page fit under
  available + evictable tokens less what is already promised, but it charges each running
  request's remaining max_new_tokens times `new_token_ratio` (0.7, decaying to 0.7 * 0.14 over
  600 decode steps: `NewTokenRatioTracker`), and a chunked admission reserves no decode tokens
  until its last chunk (`_select_prefill_admission`). When a decode step finds no room,
  `Scheduler.update_running_batch` -> `ScheduleBatch.check_decode_mem` fails and
  `retract_decode` releases requests (`release_req`: `release_kv_cache(checkpoint=False)`) and
  requeues them; that is `preempt` here;
- a prefix hit is page-aligned and at most the prompt less one token (`Req._compute_max_prefix_len`);
- the prefix cache is published per page, after the forward pass: a mid-prefill chunk is
  checkpointed into the tree at the next scheduling step (`Scheduler.stash_chunked_request`), a
  completed prefill right after its result (`process_batch_result_prefill`), decode tokens only
  when the request is released; a checkpoint frees the request's duplicate pages and points its
  `req_to_token` row at the tree's copies (`RadixCache.checkpoint`);
- eviction is explicit (`RadixCache.evict`, LRU leaves): allocation evicts what it needs first
  (`evict_from_tree_cache`), and `evict(tokens)` is SGLang's own call. A cached page nobody holds
  stays out of the free list until evicted (`cached_pages_in_free_pool=False`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import sys
import tempfile
import types
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Hashable, Iterator, List, Sequence, Tuple

from kvledger.properties.subject import CachedEntry, Capabilities, SubjectConfig, View
from kvledger.subjects.edits import EditError, SourceEdit, bind, edited_function
from kvledger.subjects.installed import InstalledPackage

log = logging.getLogger(__name__)

NAME = "sglang"
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

RADIX_CACHE = "sglang.srt.mem_cache.radix_cache"
PAGED = "sglang.srt.mem_cache.allocator.paged"
BASE_ALLOCATOR = "sglang.srt.mem_cache.allocator.base"
BASE_PREFIX_CACHE = "sglang.srt.mem_cache.base_prefix_cache"
COMMON = "sglang.srt.mem_cache.common"
ALLOCATION = "sglang.srt.mem_cache.allocation"
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch"
# The module functions this adapter calls (the scheduler's calls). An edit of one of them is
# compiled once and called in its place, by this subject alone (`SglangSubject._fn`).
FUNCTIONS: Tuple[str, ...] = (
    f"{COMMON}:checkpoint_kv_cache",
    f"{COMMON}:release_kv_cache",
    f"{COMMON}:evict_from_tree_cache",
    f"{ALLOCATION}:alloc_for_extend",
    f"{ALLOCATION}:alloc_for_decode",
)


class DriverMismatch(RuntimeError):
    """The driver asked for a range SGLang's scheduler would never schedule at this point (a
    protocol error between the driver and this adapter, not a bug of SGLang)."""


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
    stand_ins = {}
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


class _Sglang:
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
            from sglang.srt.mem_cache import allocation, common, memory_pool, radix_cache
            from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams
            from sglang.srt.mem_cache.cache_init_params import CacheInitParams
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
        self.PagedTokenToKVPoolAllocator = PagedTokenToKVPoolAllocator
        self.TokenToKVPoolAllocator = TokenToKVPoolAllocator
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


PACKAGE = InstalledPackage("sglang", VERSION, _MODULES, INSTALL, _Sglang)


def _import() -> _Sglang:
    return PACKAGE.load()


def load() -> None:
    """Import SGLang's cache modules the way this adapter does (cache directories, the torchvision
    stand-in), so that `edits.edited_function` can find an edit's target; SubjectUnavailable when
    it cannot."""
    _import()


def probe(path: str | None = None) -> Tuple[bool, str, str]:
    return PACKAGE.probe()


def build(config: SubjectConfig, path: str | None = None, edits: Sequence[SourceEdit] = ()) -> "SglangSubject":
    PACKAGE.no_path(path)
    return SglangSubject(config, _import(), edits)


@dataclass
class _Request:
    req: Any  # its sglang Req
    phase: str = "waiting"  # waiting (new or retracted) -> admitted (prefilling) -> running (decoding)
    order: int = 0  # admission order, for the running batch


class SglangSubject:
    """One radix cache, its allocator and request table, and the live `Req`s, driven as
    SGLang's `Scheduler` drives them."""

    name = NAME

    def __init__(self, config: SubjectConfig, s: _Sglang, edits: Sequence[SourceEdit] = ()) -> None:
        self.s = s
        self.version = importlib.metadata.version("sglang")
        ps = self.page_size = config.page_size
        torch = s.torch
        # ModelRunner sizes rows at the model's context length + 4 (kv_cache_configurator,
        # extra_max_context_len); here max_seq_len is that context length
        self.req_to_token_pool = s.ReqToTokenPool(
            size=config.max_running, max_context_len=config.max_seq_len + 4, device="cpu", enable_memory_saver=False
        )
        # dtype and kvcache size KV tensors the allocator never touches here; need_sort is for
        # disaggregation only (kv_cache_configurator)
        if ps == 1:
            self.allocator = s.TokenToKVPoolAllocator(
                config.num_pages, dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=False
            )
        else:
            self.allocator = s.PagedTokenToKVPoolAllocator(
                config.num_pages * ps, page_size=ps, dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=False
            )
        self.tree = s.RadixCache(
            s.CacheInitParams(
                disable=False,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.allocator,
                page_size=ps,
            )
        )
        # ScheduleBatch reads two fields of the model config on this path
        self._model_config = types.SimpleNamespace(vocab_size=1 << 31, is_encoder_decoder=False)
        # SGLang's knobs, read from the environment as its scheduler reads them at start
        # (SGLANG_INIT_NEW_TOKEN_RATIO, _MIN_NEW_TOKEN_RATIO_FACTOR, _NEW_TOKEN_RATIO_DECAY_STEPS)
        self.ratio = s.NewTokenRatioTracker.from_config()
        self.retract_decode_steps = s.envs.SGLANG_RETRACT_DECODE_STEPS.get()
        self.requests: Dict[int, _Request] = {}
        self._admissions = 0
        self._step: str | None = None  # the kind of the step in progress: "prefill", "decode" or None
        self._calls: set = set()  # (uid, call) made in the step in progress
        # this prefill pass's reservations (PrefillAdder._update_prefill_budget): uid -> (chunk, decode
        # tokens reserved, tokens its allocations have taken since)
        self._pass: Dict[int, List[int]] = {}
        self._fn: Dict[str, Callable] = {
            t: getattr(importlib.import_module(t.split(":")[0]), t.split(":")[1]) for t in FUNCTIONS
        }
        self._req_edits: List[SourceEdit] = []
        self._bind(edits)
        self.capabilities = Capabilities(
            page_size=ps,
            pages=tuple(range(1, config.num_pages + 1)),
            worst_case_admission=False,
            preempts=True,
            explicit_evict=True,
            cached_pages_in_free_pool=False,
            chunked_prefill=True,
            prefill_publishes_to_cache=True,
        )

    def _bind(self, edits: Sequence[SourceEdit]) -> None:
        """A method edit on the objects of this subject that run it (the tree, the allocator, the
        request table, or every Req it creates); a module function edit replaces the function
        this adapter calls."""
        owners = (self.tree, self.allocator, self.req_to_token_pool)
        for edit in edits:
            module_name, path = edit.split()
            if len(path) == 1:
                if edit.target not in self._fn:
                    raise EditError(
                        f"{edit.name}: {edit.target} is not a function this adapter calls ({', '.join(FUNCTIONS)})"
                    )
                self._fn[edit.target] = edited_function(edit)
                continue
            owner_class: Any = importlib.import_module(module_name)
            for part in path[:-1]:
                owner_class = getattr(owner_class, part, None)
            if not isinstance(owner_class, type):
                raise EditError(f"{edit.name}: {edit.target.rpartition('.')[0]} is not a class")
            if issubclass(self.s.Req, owner_class):
                edited_function(edit)  # EditError now rather than at the first submit
                self._req_edits.append(edit)
                continue
            found = [o for o in owners if isinstance(o, owner_class)]
            if not found:
                raise EditError(f"{edit.name}: no object of this subject is a {owner_class.__name__}")
            for owner in found:
                bind(owner, [edit])

    # -- the scheduler's bookkeeping around the cache ---------------------------------------------
    def _begin(self, kind: str, uid: int, call: str) -> None:
        """Note a call of a scheduling step; the first of a new step starts it. A step ends with
        its results (computed); one that ran nothing has none, so a call of the other kind, or a
        second call for the same request, starts the next step too."""
        if self._step == kind and (uid, call) not in self._calls:
            self._calls.add((uid, call))
            return
        self._step = kind
        self._calls = {(uid, call)}
        self._pass = {}
        if kind == "decode":
            # update_running_batch: a decode step that needs no retraction decays the ratio; a
            # retraction (preempt) sets it afresh instead
            self.ratio.decay_step()

    def _running(self) -> List[_Request]:
        return sorted((r for r in self.requests.values() if r.phase == "running"), key=lambda r: r.order)

    def _available_and_evictable(self) -> int:
        return self.allocator.available_size() + self.tree.evictable_size()

    def _prefill_budget(self) -> Any:
        """The PrefillAdder's memory budget as it stands now in this pass: SGLang's PrefillBudget
        (allocator.create_prefill_budget) charged the running requests' estimated decode tokens
        (PrefillAdder.__init__, _get_running_request_total_token_offset) and this pass's
        admissions (_update_prefill_budget -> PrefillBudget.reserve). SGLang allocates the whole
        batch after the adder is done; the driver allocates each request right after admitting
        it, so what an admission of this pass has allocated since is taken off its reservation."""
        budget = self.allocator.create_prefill_budget(self.tree)
        clip = self.s.CLIP_MAX_NEW_TOKENS
        for r in self._running():
            req = r.req
            ratio = 1.0 if req.sampling_params.ignore_eos else self.ratio.current
            budget.total_offset += min(req.sampling_params.max_new_tokens - len(req.output_ids), clip) * ratio
        for chunk, decode_tokens, taken in self._pass.values():
            budget.reserve(chunk, decode_tokens)
            budget.total_offset -= taken
            budget.current_offset -= taken
        return budget

    def _max_new(self, req: Any) -> int:
        return min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), self.s.CLIP_MAX_NEW_TOKENS)

    def _batch(self, req: Any) -> Any:
        return self.s.ScheduleBatch.init_new(
            [req], self.req_to_token_pool, self.allocator, self.tree, self._model_config, False, self.s.NONE
        )

    def _idle(self) -> None:
        # Scheduler.self_check_during_idle ends with new_token_ratio_tracker.reset()
        if not self.requests:
            self.ratio.reset()

    # -- the protocol --------------------------------------------------------------------------
    def submit(self, uid: int, prompt: Sequence[int], max_tokens: int) -> None:
        # TokenizerManager: SamplingParams.normalize; Scheduler.handle_generate_request builds the Req
        params = self.s.SamplingParams(max_new_tokens=max_tokens)
        params.normalize(None)
        req = self.s.Req(str(uid), "", array("q", [int(t) for t in prompt]), params, vocab_size=1 << 31)
        if self._req_edits:
            bind(req, self._req_edits)
        self.requests[uid] = _Request(req)

    def admit(self, uid: int, budget: int) -> int | None:
        r = self.requests[uid]
        if r.phase != "waiting":
            raise DriverMismatch(f"uid {uid}: admitted while {r.phase}")
        self._begin("prefill", uid, "admit")
        req = r.req
        # Scheduler.get_new_batch_prefill: the walk stops when no request row is left
        # (get_num_allocatable_reqs; rows are taken at allocation, so count admitted-not-allocated)
        unallocated = sum(1 for o in self.requests.values() if o.phase == "admitted" and not o.req.kv.holds_kv)
        if self.req_to_token_pool.available_size() - unallocated <= 0 or budget <= 0:
            return None
        # ... then req.init_next_round_input(tree_cache): refresh fill ids, match_kv_cache
        req.init_next_round_input(self.tree)
        # PrefillAdder.add_one_req: total_tokens = the rest of the prompt + its decode tokens + a
        # page; checked (PrefillBudget.check_prefill) with the match locked so that it is not
        # counted as evictable (_lock_node), committed with a lock of its own
        # (_commit_prefill_admission). SGLang cuts a chunk at a page boundary
        # (_select_prefill_admission); the driver chooses the chunk here, which may end mid-page.
        max_new = self._max_new(req)
        extend = len(req.full_untruncated_fill_ids) - req.prefix_len
        total_tokens = extend + max_new + self.page_size
        pin = self.tree.lock(req.last_node)
        try:
            fits, _ = self._prefill_budget().check_prefill(
                extend_input_len=extend,
                total_tokens=total_tokens,
                max_new_tokens=max_new,
                input_tokens=len(req.full_untruncated_fill_ids),
                swa_host_hit_length=0,
                chunk_limit=budget,
            )
            if not fits:
                log.debug("sglang: uid %d refused (hit %d, %d tokens wanted)", uid, req.prefix_len, total_tokens)
                return None
            chunk = min(extend, budget)
            req.extend_end = req.prefix_len + chunk
            req.lock = self.tree.lock(req.last_node)
        finally:
            self.tree.unlock(pin)
        # a chunked admission reserves no decode tokens (is_chunked: max_new_tokens = 0)
        self._pass[uid] = [chunk, max_new if chunk == extend else 0, 0]
        self._admissions += 1
        r.phase, r.order = "admitted", self._admissions
        return req.prefix_len

    def allocate(self, uid: int, start: int, end: int) -> bool:
        r = self.requests[uid]
        req = r.req
        torch = self.s.torch
        if r.phase == "running":
            # Scheduler.update_running_batch: check_decode_mem, then prepare_for_decode ->
            # alloc_for_decode(batch, token_per_req=1), one request at a time here
            self._begin("decode", uid, "allocate")
            if start != req.kv.kv_committed_len or end != start + 1:
                raise DriverMismatch(
                    f"uid {uid}: decode [{start}, {end}) with {req.kv.kv_committed_len} positions holding KV"
                )
            batch = self._batch(req)
            batch.seq_lens = batch.seq_lens_cpu = torch.tensor([start], dtype=torch.int64)
            batch.req_pool_indices = batch.req_pool_indices_cpu = torch.tensor([req.kv.req_pool_idx], dtype=torch.int64)
            # check_decode_mem evicts until the step fits and says whether it does; nothing may
            # change when it does not, so the same question is asked first without evicting
            need = batch.new_tokens_required_next_decode()
            if need > self._available_and_evictable() or not batch.check_decode_mem():
                self._calls.discard((uid, "allocate"))  # retried after a retraction, in this step
                return False
            self._fn[f"{ALLOCATION}:alloc_for_decode"](batch, 1)
            return True
        if r.phase != "admitted":
            raise DriverMismatch(f"uid {uid}: allocate while {r.phase}")
        self._begin("prefill", uid, "allocate")
        if start != req.prefix_len or end <= start or end > len(req.full_untruncated_fill_ids):
            raise DriverMismatch(
                f"uid {uid}: allocate [{start}, {end}) with {req.prefix_len} positions computed "
                f"of {len(req.full_untruncated_fill_ids)}"
            )
        if uid not in self._pass:
            # the request mid-prefill: PrefillAdder.add_chunked_req reserves its next chunk, and
            # its decode tokens when the chunk ends the prompt
            done = end == len(req.full_untruncated_fill_ids)
            self._pass[uid] = [end - start, self._max_new(req) if done else 0, 0]
        req.extend_end = end
        # alloc_paged_token_slots_extend (alloc_token_slots at page size 1) evicts, then
        # allocates; it raises when the pool cannot serve the chunk (the adder promised it could):
        # the same question first, without evicting
        ps = self.page_size
        new_pages = (
            self.s.get_num_new_pages(seq_lens=torch.tensor([end]), page_size=ps, prefix_lens=torch.tensor([start]))
            if ps > 1
            else end - start
        )
        if int(new_pages) * ps > self._available_and_evictable():
            self._calls.discard((uid, "allocate"))  # retried after a retraction, in this step
            return False
        # ScheduleBatch.prepare_for_extend sets these, then calls alloc_for_extend(self)
        batch = self._batch(req)
        batch.prefix_lens, batch.extend_lens = [req.prefix_len], [req.extend_len]
        batch.seq_lens = batch.seq_lens_cpu = torch.tensor([end], dtype=torch.int64)
        batch.extend_num_tokens = req.extend_len
        self._fn[f"{ALLOCATION}:alloc_for_extend"](batch)
        req.is_retracted = False
        self._pass[uid][2] += int(new_pages) * ps
        return True

    def computed(self, uid: int, start: int, end: int, token: int | None) -> None:
        r = self.requests[uid]
        req = r.req
        self._step = None
        if r.phase == "running":
            # process_batch_result_decode: append the token, update_finish_state; nothing goes to
            # the tree until the request is released
            if start != req.kv.kv_committed_len - 1 or token is None:
                raise DriverMismatch(f"uid {uid}: decode result for [{start}, {end}), token {token}")
            req.output_ids.append(int(token))
            req.update_finish_state()
            return
        if r.phase != "admitted" or end != req.extend_end:
            raise DriverMismatch(
                f"uid {uid}: computed [{start}, {end}) while {r.phase}, extend ends at {req.extend_end}"
            )
        if token is None:
            # a middle chunk: Scheduler.get_next_batch_to_run -> stash_chunked_request ->
            # checkpoint_kv_cache, before the next chunk is scheduled
            if end >= len(req.full_untruncated_fill_ids):
                raise DriverMismatch(f"uid {uid}: the prompt's last chunk came without a token")
            self._fn[f"{COMMON}:checkpoint_kv_cache"](req, self.tree)
            return
        # process_batch_result_prefill: append the token, update_finish_state; a request that goes
        # on is checkpointed now, one that finished (max_new_tokens reached) is released by finish
        if end != len(req.full_untruncated_fill_ids):
            raise DriverMismatch(f"uid {uid}: a token after [{start}, {end}) of {len(req.full_untruncated_fill_ids)}")
        req.output_ids.append(int(token))
        req.update_finish_state()
        r.phase = "running"
        if not req.finished():
            self._fn[f"{COMMON}:checkpoint_kv_cache"](req, self.tree)

    def finish(self, uid: int) -> None:
        # the driver stops a request on max_tokens (update_finish_state already said so) or on a
        # stop token (what _check_token_based_finish sets); then
        # _handle_finish_state_updated_req -> release_kv_cache(checkpoint=True), which inserts
        # what it holds, frees the rest and its request row
        r = self.requests[uid]
        req = r.req
        if r.phase != "running":
            raise DriverMismatch(f"uid {uid}: finish while {r.phase}")
        del self.requests[uid]
        if not req.finished():
            req.finished_reason = self.s.FINISH_MATCHED_TOKEN(matched=req.output_ids[-1])
            req.finished_len = len(req.output_ids)
        self._fn[f"{COMMON}:release_kv_cache"](req, self.tree, checkpoint=True)
        self._idle()

    def abort(self, uid: int) -> None:
        r = self.requests.pop(uid)
        req = r.req
        if r.phase == "running":
            # Scheduler.abort_request, method 3: to_finish = FINISH_ABORT, and the request leaves
            # through the finish path (release_kv_cache(checkpoint=True)); SGLang first runs one more
            # decode step for it, whose token is dropped
            req.finished_reason = self.s.FINISH_ABORT()
            self._fn[f"{COMMON}:release_kv_cache"](req, self.tree, checkpoint=True)
        elif r.phase == "admitted":
            # process_pending_chunked_abort: release_kv_cache(checkpoint=False). Admitted but not
            # yet allocated (a window SGLang's scheduler does not have): only its match lock
            self._release(req)
        # waiting: abort method 1, popped from the queue, it holds nothing
        self._pass.pop(uid, None)
        self._idle()

    def preempt(self, uid: int) -> None:
        # ScheduleBatch.retract_decode -> release_req: release_kv_cache(checkpoint=False), evict what
        # the remaining requests' next SGLANG_RETRACT_DECODE_STEPS decode steps need, reset_for_retract
        # (it keeps its output tokens: its next admission's prompt is origin + output); then the
        # scheduler sets new_token_ratio from the requests still running
        r = self.requests[uid]
        if r.phase == "waiting":
            raise DriverMismatch(f"uid {uid}: preempt of a waiting request")
        req = r.req
        self._release(req)
        remaining = [o for o in self._running() if o is not r]
        self._fn[f"{COMMON}:evict_from_tree_cache"](self.tree, len(remaining) * self.retract_decode_steps)
        req.reset_for_retract()
        r.phase = "waiting"
        self._pass.pop(uid, None)
        self.ratio.current = self.s.NewTokenRatioTracker.estimate_new_token_ratio_after_retract(
            [o.req for o in remaining]
        )

    def _release(self, req: Any) -> None:
        if req.kv.holds_kv:
            self._fn[f"{COMMON}:release_kv_cache"](req, self.tree, checkpoint=False)
        else:
            self.tree.unlock(req.lock)
            req.lock = None

    def evict(self, tokens: int) -> int:
        return int(self.tree.evict(self.s.EvictParams(num_tokens=tokens)).num_tokens_evicted)

    # -- what the judge reads --------------------------------------------------------------------
    def view(self) -> View:
        rows = self.req_to_token_pool.req_to_token
        requests: Dict[int, List[int]] = {}
        for uid, r in self.requests.items():
            if r.phase == "waiting":
                continue
            req = r.req
            if req.kv.holds_kv:
                # its row up to what it has allocated: [0, kv_allocated_len)
                requests[uid] = rows[req.kv.req_pool_idx, : req.kv.kv_allocated_len].tolist()
            else:
                # admitted, no chunk allocated yet: it holds its locked match, which the first
                # allocation copies into its row (allocation._prefix_kv_indices)
                requests[uid] = self.tree.prefix_device_indices(req).tolist()
        allocator = self.allocator
        if isinstance(allocator, self.s.PagedTokenToKVPoolAllocator):
            free = allocator.free_pages.tolist() + [p for part in allocator.staged_pages for p in part.tolist()]
        else:
            free = allocator.free_pages.tolist() + allocator.release_pages.tolist()
        return View(
            free=free,
            requests=requests,
            cached=self._entries(),
            counters={
                "free_pages": allocator.available_size() // self.page_size,
                "evictable_tokens": int(self.tree.evictable_size()),
                "protected_tokens": int(self.tree.protected_size()),
                "cached_tokens": int(self.tree.total_size()),
                # what the PrefillAdder counts as room (PrefillBudget._available_and_evictable)
                "available_tokens": int(allocator.create_prefill_budget(self.tree)._available_and_evictable()),
            },
        )

    def _entries(self) -> List[CachedEntry]:
        """One entry per tree node, found down the children maps; its tokens are read up its own
        parent pointers, so a node whose links disagree shows a path other than where it hangs."""
        root = self.tree.root_node
        entries: List[CachedEntry] = []
        stack = list(root.children.values())
        seen = 0
        while stack and seen <= 1 << 16:  # a cycle in the children maps shows as many entries, not a hang
            node = stack.pop()
            seen += 1
            path: List[array] = []
            up = node
            while up is not None and up is not root and len(path) < 1 << 16:
                path.append(up.key.token_ids)
                up = up.parent
            tokens = tuple(int(t) for part in reversed(path) for t in part)
            locations = tuple(node.value.tolist()) if node.value is not None else ()
            entries.append(
                CachedEntry(
                    locations=locations,
                    start=len(tokens) - len(node.key),
                    tokens=tokens,
                    lock=int(node.lock_ref),
                    name=f"node {node.id}",
                )
            )
            stack.extend(node.children.values())
        return entries

    def cache_key(self, tokens: Sequence[int]) -> Hashable:
        return tuple(int(t) for t in tokens)  # a radix tree files by path; the judge never asks


# Single edits to sglang 0.5.23 (texts as in the dedented source), each bound on the one object
# of a subject that runs it (the RadixCache, the allocator, every Req), or, for a module function,
# replacing the function the adapter calls.
ZOO: Tuple[SourceEdit, ...] = (
    SourceEdit(
        "sglang-split-node-drops-lock",
        f"{RADIX_CACHE}:RadixCache._split_node",
        "new_node.lock_ref = child.lock_ref",
        "new_node.lock_ref = 0",
        "splitting a locked node without copying its lock to the new parent: the shared head of a "
        "path in use counts as evictable, and an allocation can evict it under its holder",
    ),
    SourceEdit(
        "sglang-inc-lock-ref-leaf-only",
        f"{RADIX_CACHE}:RadixCache.inc_lock_ref",
        "while node != self.root_node:",
        "if node != self.root_node:",
        "locking only the matched node, not its ancestors: a match that ends below the first node "
        "leaves the path above it evictable, and the unlock walks the whole path down past zero",
    ),
    SourceEdit(
        "sglang-dec-lock-ref-keeps-protected",
        f"{RADIX_CACHE}:RadixCache.dec_lock_ref",
        "if node.lock_ref == 1:",
        "if node.lock_ref == 0:",
        "testing the count after the decrement as if before: a node its last holder unlocks is never "
        "counted evictable again, so the cache's sizes drift from its nodes",
    ),
    SourceEdit(
        "sglang-evict-forgets-free",
        f"{RADIX_CACHE}:RadixCache.evict",
        "self.token_to_kv_pool_allocator.free_segment(x.value, start_pos=0)",
        "pass",
        "deleting an evicted leaf without giving its pages back: every eviction leaks its pages",
    ),
    SourceEdit(
        "sglang-insert-frees-from-zero",
        f"{RADIX_CACHE}:RadixCache._insert_cache",
        "kv_indices[req.kv.cache_protected_len : result.prefix_len]",
        "kv_indices[: result.prefix_len]",
        "freeing the duplicates a checkpoint found from the row's start instead of past the prefix the "
        "tree already owns: the request's own matched pages, still cached and locked, go back to the "
        "free list",
    ),
    SourceEdit(
        "sglang-checkpoint-keeps-duplicate-row",
        f"{RADIX_CACHE}:RadixCache.checkpoint",
        "self.req_to_token_pool.write(\n"
        "        (req.kv.req_pool_idx, slice(req.kv.cache_protected_len, len(new_indices))),\n"
        "        new_indices[req.kv.cache_protected_len :],\n"
        "    )",
        "pass",
        "freeing the request's duplicate pages without pointing its row at the tree's copies (the "
        "mini-sglang bug of PR #142): a running request keeps reading pages that were freed",
    ),
    SourceEdit(
        "sglang-free-segment-every-token",
        f"{PAGED}:PagedTokenToKVPoolAllocator.free_segment",
        "reps = free_index[::ps]",
        "reps = free_index",
        "dropping the page stride when turning a segment into pages: each freed page is put back once "
        "per token it held",
    ),
    SourceEdit(
        "sglang-release-frees-protected",
        f"{COMMON}:release_kv_cache",
        "tree_cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, owned_kv_len)])",
        "tree_cache.free_kv_row(req.kv, [(0, owned_kv_len)])",
        "freeing the whole row at release, the prefix the tree owns included: cached pages go back to "
        "the free list while the tree (and any request that hits them) still uses them",
    ),
    SourceEdit(
        "sglang-release-keeps-lock",
        f"{COMMON}:release_kv_cache",
        "tree_cache.unlock(req.lock)\n",
        "\n",
        "releasing a request without dropping its tree lock: its path stays locked after it ends, never evictable",
    ),
    SourceEdit(
        "sglang-hit-covers-last-token",
        f"{SCHEDULE_BATCH}:Req._compute_max_prefix_len",
        "max_prefix_len = input_len - 1",
        "max_prefix_len = input_len",
        "letting the match run to the end of the prompt: a fully cached prompt of whole pages is "
        "admitted with nothing to compute, so no forward pass yields its next token",
    ),
)
