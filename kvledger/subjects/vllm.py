"""vLLM's `KVCacheManager` (v1 engine, the installed vllm 0.33.0) as a kvledger subject.

One `KVCacheManager` over one full-attention KV cache group, driven with real
`vllm.v1.request.Request` objects in the order vLLM's own scheduler drives it
(`vllm/v1/core/sched/scheduler.py`, `Scheduler.schedule`, `_update_after_schedule`,
`update_from_output`, `_preempt_request`, `_free_request`, `finish_requests`). Only the cache
manager runs: no model, no GPU, no engine process.

What vLLM does that the driver must know (the capabilities):
- block 0 is the null block, never handed out: the pool has `num_pages + 1` blocks and the pages
  are block ids 1..num_pages;
- admission checks that the whole sequence fits (`scheduler_reserve_full_isl`, on by default)
  but allocates only the first chunk, so a later chunk or decode step can find no room; the
  scheduler then preempts the last running request (`allocate` returns False here);
- a prefix hit is in whole blocks and never covers the last token (`get_computed_blocks` caps it
  at `num_tokens - 1` so that token's logits are computed);
- full blocks are hashed and filed in the prefix cache inside `allocate_slots`, when their
  slots are allocated (their token ids are known then), before the forward pass writes their KV:
  a request admitted later in the same step can hit them, and reads them in that same forward
  pass (vLLM writes every layer's KV for the batch before that layer's attention);
- a block nobody uses but that is cached sits in the free queue with its hash, and is evicted
  (unfiled) only when `get_new_blocks` hands it out again: eviction is implicit, LRU.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
from typing import Any, Dict, Hashable, List, Sequence, Tuple

from kvledger.properties.subject import Capabilities, DriverMismatch, SubjectConfig, View
from kvledger.subjects.edits import SourceEdit, bind_to_instances
from kvledger.subjects.installed import InstalledPackage
from kvledger.subjects.vllm_pool import CacheKeys, cached_blocks, free_queue

log = logging.getLogger(__name__)

NAME = "vllm"
VERSION = "0.33.0"  # the version the zoo's edit texts are written against
# What `python -c "import vllm.v1.core.kv_cache_manager"` needs on top of the project's
# environment; the exact pins are in subjects-constraints.txt. Never without --no-deps: vllm
# pins a CUDA build of torch.
PACKAGES: Tuple[str, ...] = (
    "vllm",
    "apache-tvm-ffi",
    "cachetools",
    "cbor2",
    "cloudpickle",
    "llguidance",
    "msgspec",
    "oss-harmony",
    "partial-json-parser",
    "prometheus-client",
    "py-cpuinfo",
    "pybase64",
    "pyzmq",
    "uvloop",
    "xgrammar",
)
INSTALL = f"pip install --no-deps -c subjects-constraints.txt {' '.join(PACKAGES)}"
# modules of those packages the import chain reaches (probe checks them without importing)
_MODULES: Tuple[str, ...] = (
    "vllm",
    "tvm_ffi",
    "cachetools",
    "cbor2",
    "cloudpickle",
    "llguidance",
    "msgspec",
    "openai_harmony",
    "partial_json_parser",
    "prometheus_client",
    "cpuinfo",
    "pybase64",
    "zmq",
    "uvloop",
    "xgrammar",
)

KV_CACHE_MANAGER = "vllm.v1.core.kv_cache_manager"
BLOCK_POOL = "vllm.v1.core.block_pool"
SINGLE_TYPE = "vllm.v1.core.single_type_kv_cache_manager"
KV_CACHE_UTILS = "vllm.v1.core.kv_cache_utils"
GROUP_ID = 0  # the one KV cache group; vLLM appends it to every hash it files


class _Vllm:
    """The vLLM names the adapter uses, imported once."""

    def __init__(self) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core import block_pool, kv_cache_manager, kv_cache_utils, single_type_kv_cache_manager
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request, RequestStatus

        self.torch = torch
        self.SamplingParams = SamplingParams
        self.sha256 = sha256
        self.kv_cache_manager = kv_cache_manager
        self.block_pool = block_pool
        self.kv_cache_utils = kv_cache_utils
        self.single_type = single_type_kv_cache_manager
        self.FullAttentionSpec = FullAttentionSpec
        self.KVCacheConfig = KVCacheConfig
        self.KVCacheGroupSpec = KVCacheGroupSpec
        self.Request = Request
        self.RequestStatus = RequestStatus
        # EngineCore does this once per process before any request is hashed (else NONE_HASH is
        # unset); sha256 is what `--prefix-caching-hash-algo` defaults to, and its seed is fixed,
        # so every subject in this process files a prefix under the same key
        kv_cache_utils.init_none_hash(sha256)


PACKAGE = InstalledPackage("vllm", VERSION, _MODULES, INSTALL, _Vllm)


def _import() -> _Vllm:
    return PACKAGE.load()


def probe(path: str | None = None) -> Tuple[bool, str, str]:
    return PACKAGE.probe()


def build(config: SubjectConfig, path: str | None = None, edits: Sequence[SourceEdit] = ()) -> "VllmSubject":
    PACKAGE.no_path(path)
    return VllmSubject(config, _import(), edits)


class VllmSubject:
    """One `KVCacheManager` and its live `Request`s, driven as `Scheduler` drives them."""

    name = NAME

    def __init__(self, config: SubjectConfig, v: _Vllm, edits: Sequence[SourceEdit] = ()) -> None:
        self.v = v
        self.version = importlib.metadata.version("vllm")
        bs = self.block_size = config.page_size
        # the attention shape only sizes KV tensors the manager never allocates
        spec = v.FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=v.torch.float16)
        kv_config = v.KVCacheConfig(
            num_blocks=config.num_pages + 1,  # + the null block 0
            kv_cache_tensors=[],
            kv_cache_groups=[v.KVCacheGroupSpec(["layer.0"], spec)],
        )
        self.mgr = v.kv_cache_manager.KVCacheManager(
            kv_config,
            max_model_len=config.max_seq_len,
            scheduler_block_size=bs,
            hash_block_size=bs,
            enable_caching=True,
        )
        self.pool = self.mgr.block_pool
        self._block_hasher = v.kv_cache_utils.get_request_block_hasher(bs, v.sha256)
        self._bind(edits)
        self.capabilities = Capabilities(
            page_size=bs,
            pages=tuple(range(1, config.num_pages + 1)),
            worst_case_admission=False,
            preempts=True,
            explicit_evict=False,
            cached_pages_in_free_pool=True,
            chunked_prefill=True,
            prefill_publishes_to_cache=True,
        )
        self.requests: Dict[int, Any] = {}  # uid -> its vLLM Request, from submit until it ends
        self.running: Dict[int, None] = {}  # Scheduler.running: admitted uids, in admission order
        # the end of the range allocate_slots last gave slots for (Scheduler.schedule advances
        # num_computed_tokens right after scheduling; here computed() does, after the forward pass)
        self.allocated: Dict[int, int] = {}
        self._keys = CacheKeys(bs)

    def _bind(self, edits: Sequence[SourceEdit]) -> None:
        """Each edit on the one object of this manager that runs the target's method."""
        coordinator = self.mgr.coordinator
        owners = (
            self.mgr,
            coordinator,
            *coordinator.single_type_managers,
            self.pool,
            self.pool.free_block_queue,
            self.pool.cached_block_hash_to_block,
        )
        bind_to_instances(edits, owners, "KVCacheManager")

    # -- the protocol --------------------------------------------------------------------------
    def submit(self, uid: int, prompt: Sequence[int], max_tokens: int) -> None:
        # Scheduler.add_request gets the Request EngineCore built: its block hasher hashes every
        # full block of the prompt now, and of the output as tokens are appended
        self.requests[uid] = self.v.Request(
            str(uid),
            [int(t) for t in prompt],
            self.v.SamplingParams(max_tokens=max_tokens),
            None,
            block_hasher=self._block_hasher,
        )

    def admit(self, uid: int, budget: int) -> int | None:
        # Scheduler.schedule, the WAITING loop, for a request with num_computed_tokens == 0 (new or
        # preempted): get_computed_blocks (the local prefix hit), num_new_tokens = num_tokens - hit
        # capped by the token budget, then allocate_slots with the hit blocks. None: the walk stops
        # (`break`) and the request stays waiting; allocate_slots checks before it touches anything.
        req = self.requests[uid]
        if uid in self.running or req.num_computed_tokens != 0:
            raise DriverMismatch(f"uid {uid}: admitted again with {req.num_computed_tokens} tokens computed")
        if budget <= 0:
            return None  # `while token_budget > 0` never reaches it
        hit_blocks, hit, _boundary = self.mgr.get_computed_blocks(req)
        num_new = min(req.num_tokens - hit, budget)
        new_blocks = self.mgr.allocate_slots(
            req,
            num_new,
            num_new_computed_tokens=hit,
            new_computed_blocks=hit_blocks,
            full_sequence_must_fit=True,  # SchedulerConfig.scheduler_reserve_full_isl's default
            has_scheduled_reqs=bool(self.running),
        )
        if new_blocks is None:
            log.debug("vllm: uid %d refused (hit %d, %d new tokens)", uid, hit, num_new)
            return None
        # then: running.append, status RUNNING, num_computed_tokens = the hit
        self.running[uid] = None
        req.status = self.v.RequestStatus.RUNNING
        req.num_computed_tokens = hit
        self.allocated[uid] = hit + num_new
        return hit

    def allocate(self, uid: int, start: int, end: int) -> bool:
        req = self.requests[uid]
        if uid not in self.running or start != req.num_computed_tokens or end <= start:
            raise DriverMismatch(
                f"uid {uid}: allocate [{start}, {end}) with {req.num_computed_tokens} computed "
                f"({'running' if uid in self.running else 'not admitted'})"
            )
        if end <= self.allocated[uid]:
            return True  # the admission's allocate_slots already gave this chunk its slots
        # Scheduler.schedule, the RUNNING loop: allocate_slots(request, num_new_tokens); None makes
        # the scheduler preempt the last running request and try again (the driver does that)
        if self.mgr.allocate_slots(req, end - start) is None:
            return False
        self.allocated[uid] = end
        return True

    def computed(self, uid: int, start: int, end: int, token: int | None) -> None:
        # _update_after_schedule advances num_computed_tokens by the scheduled tokens;
        # update_from_output -> _update_request_with_output appends the sampled token
        # (append_output_token_ids, which hashes any block it completes). Nothing here calls the
        # cache manager: vLLM filed the full blocks when allocate_slots gave them slots.
        req = self.requests[uid]
        if start != req.num_computed_tokens or end > self.allocated.get(uid, -1):
            raise DriverMismatch(
                f"uid {uid}: computed [{start}, {end}) but {req.num_computed_tokens} are computed "
                f"and slots go up to {self.allocated.get(uid)}"
            )
        req.num_computed_tokens = end
        if token is not None:
            req.append_output_token_ids(int(token))

    def finish(self, uid: int) -> None:
        # update_from_output: a stopped request -> _free_request -> _free_blocks ->
        # _free_request_blocks -> kv_cache_manager.free (its blocks, tail first)
        req = self.requests[uid]
        req.status = self.v.RequestStatus.FINISHED_STOPPED
        self.mgr.free(req)
        self._forget(uid)

    def abort(self, uid: int) -> None:
        # finish_requests(FINISHED_ABORTED): out of the running or waiting queue, then
        # _free_request, which frees whatever it holds (nothing when it was waiting)
        req = self.requests[uid]
        req.status = self.v.RequestStatus.FINISHED_ABORTED
        self.mgr.free(req)
        self._forget(uid)

    def preempt(self, uid: int) -> None:
        # _preempt_request (the caller popped it from running): its blocks freed, status
        # PREEMPTED, num_computed_tokens = 0, prepended to the waiting queue; it keeps its output
        # tokens and block hashes, so its next admission can hit its own freed blocks
        req = self.requests[uid]
        if req.status != self.v.RequestStatus.RUNNING:
            raise DriverMismatch(f"uid {uid}: preempt of a request that is {req.status.name}")
        self.running.pop(uid, None)
        self.allocated.pop(uid, None)
        self.mgr.free(req)
        req.status = self.v.RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1

    def evict(self, tokens: int) -> int:
        # vLLM evicts by reuse only (get_new_blocks unfiles a cached block it hands out).
        # BlockPool.evict_blocks(ids) exists for KV connectors that report lost blocks; which
        # blocks to drop would be this adapter's choice, not vLLM's, so it is not offered.
        return 0

    def _forget(self, uid: int) -> None:
        self.requests.pop(uid, None)
        self.running.pop(uid, None)
        self.allocated.pop(uid, None)

    # -- what the judge reads --------------------------------------------------------------------
    def view(self) -> View:
        pool, bs = self.pool, self.block_size
        requests: Dict[int, List[int]] = {}
        for uid in self.running:
            req = self.requests[uid]
            (table,) = self.mgr.get_block_ids(req.request_id)
            # the positions its block table covers, up to the tokens it has; the model runner maps
            # position p to slot table[p // bs] * bs + p % bs
            held = min(req.num_tokens, len(table) * bs)
            requests[uid] = [table[p // bs] * bs + p % bs for p in range(held)]
        cached = cached_blocks(pool, bs)
        return View(
            free=free_queue(pool),
            requests=requests,
            cached=cached,
            # the null block's ref_cnt is not maintained (BlockPool.__init__)
            page_refs={blk.block_id: blk.ref_cnt for blk in pool.blocks if blk is not pool.null_block},
            counters={"free_pages": pool.get_num_free_blocks()},
        )

    def cache_key(self, tokens: Sequence[int]) -> Hashable:
        """The key BlockPool.cache_full_blocks files the prefix's last full block under
        (`vllm_pool.CacheKeys`: vLLM's module functions, never a bound, possibly edited, method);
        None when it has no full block."""
        return self._keys.key(tokens, GROUP_ID)


# Single edits to vllm 0.33.0 (texts as in the method's dedented source), each bound on the one
# object of a KVCacheManager that runs it: the manager, its BlockPool, the FullAttentionManager,
# the FreeKVCacheBlockQueue.
ZOO: Tuple[SourceEdit, ...] = (
    SourceEdit(
        "vllm-free-blocks-frees-shared",
        f"{BLOCK_POOL}:BlockPool.free_blocks",
        "if block.ref_cnt == 0:",
        "if block.ref_cnt <= 1:",
        "testing the count against 1 as if before the decrement: a prefix block two requests share "
        "goes back to the free queue when the first of them finishes, under the other",
    ),
    SourceEdit(
        "vllm-free-blocks-drops-uncached",
        f"{BLOCK_POOL}:BlockPool.free_blocks",
        "self.free_block_queue.prepend_n(blocks_to_evict_first)",
        "pass",
        "losing the prepend of the blocks that carry no hash when splitting a free into the LRU "
        "tail and the reuse-first head: every partial (unhashed) block leaks",
    ),
    SourceEdit(
        "vllm-touch-increments-first",
        f"{BLOCK_POOL}:BlockPool.touch",
        "if block.ref_cnt == 0:\n            self.free_block_queue.remove(block)\n        block.ref_cnt += 1",
        "block.ref_cnt += 1\n        if block.ref_cnt == 0:\n            self.free_block_queue.remove(block)",
        "taking the reference before testing whether the block is free: a hit on a cached block in "
        "the free queue leaves it there, and get_new_blocks can hand it to another request",
    ),
    SourceEdit(
        "vllm-reuse-keeps-stale-hash",
        f"{BLOCK_POOL}:BlockPool.get_new_blocks",
        "self._maybe_evict_cached_block(block)",
        "pass",
        "handing a cached block out again without unfiling its hash: the map keeps pointing at a "
        "block whose KV is overwritten by another prefix, and a later prompt hits the wrong KV",
    ),
    SourceEdit(
        "vllm-cache-full-blocks-hash-offset",
        f"{BLOCK_POOL}:BlockPool.cache_full_blocks",
        "block_hash = new_block_hashes[i]",
        "block_hash = block_hashes[i]",
        "indexing the request's hashes from its first block instead of the first newly full one: "
        "after a prefix hit or an earlier chunk, a block is filed under an earlier block's hash",
    ),
    SourceEdit(
        "vllm-hit-covers-last-token",
        f"{KV_CACHE_MANAGER}:KVCacheManager.get_computed_blocks",
        "max_cache_hit_length = request.num_tokens - 1",
        "max_cache_hit_length = request.num_tokens",
        "letting the hit run to the end of the prompt: a fully cached prompt of whole blocks is "
        "admitted with nothing to compute, so no forward pass yields its next token",
    ),
    SourceEdit(
        "vllm-allocate-new-blocks-floor",
        f"{SINGLE_TYPE}:SingleTypeKVCacheManager.allocate_new_blocks",
        "num_required_blocks = cdiv(num_tokens, self.block_size)",
        "num_required_blocks = num_tokens // self.block_size",
        "rounding the block count down: the tokens past the last full block get no slot",
    ),
    SourceEdit(
        "vllm-admission-ignores-evictable-hits",
        f"{SINGLE_TYPE}:SingleTypeKVCacheManager.get_num_blocks_to_allocate",
        "return num_new_blocks + num_evictable_blocks",
        "return num_new_blocks",
        "not counting hit blocks that sit in the free queue, which touching them takes out of it: "
        "the room check passes and get_new_blocks then lacks blocks",
    ),
    SourceEdit(
        "vllm-free-queue-remove-keeps-count",
        f"{KV_CACHE_UTILS}:FreeKVCacheBlockQueue.remove",
        "self.num_free_blocks -= 1",
        "pass",
        "unlinking a block from the middle of the free queue without counting it out: the pool "
        "reports a free block that is not there",
    ),
)
