"""`sglang:hicache`: SGLang 0.5.23's hierarchical cache (HiCache), its scheduler side, on a CPU.

The default tree (`UnifiedRadixCache`, FULL) at page size > 1 with `sglang:paged`'s decode memory
check and retraction, and a host-memory tier behind the device pool, built as the scheduler builds
it: `registry.create_unified_radix_cache` (registry.py:149) calls `UnifiedRadixCache.init_hicache`
(unified_radix_cache.py:455) when `enable_hierarchical_cache` is set, which attaches a host pool
(`MHATokenToKVPoolHost`, pool_host/mha.py) and a `HybridCacheController`
(`hybrid_pool_assembler.attach_hybrid_pool_to_unified_cache`). The deployment (`HICACHE_ARGS`, real
ServerArgs, published in a runtime context of this subject's own): write-through (every node the
tree inserts is backed up to host), the "direct" I/O backend and the layer-first host layout (the
one pair whose copy is a plain tensor copy), twice the device pool on host.

The device KV pool is a real `MHATokenToKVPool` on the CPU with one int64 element per token and
layer. The adapter plays the model's forward pass: `computed` writes into the K buffer of every
layer, at the locations of the positions computed, the hash of the token prefix each position's KV
encodes (`invariants.prefix_hashes`, the judge's own), and its length into the V buffer. SGLang's
own transfer code copies those to host at backup and back to device at load-back, so what a load
put where is read from the KV buffer itself: `landed` hands the driver (location, prefix hash,
length) for each position a load filled, and the judge checks that the loaded KV is the KV of the
request's tokens (7-kv-provenance), as for any location a forward pass wrote.

The scheduler's calls, in its order:
- step top (`Scheduler.get_next_batch_to_run`, scheduler.py:3894): `_process_hicache_events` ->
  `tree_cache.check_hicache_events()` (:3889: submit queued backups, reap finished write and load
  acks), before the chunked request is stashed;
- admission (`PrefillAdder.add_one_req`, schedule_policy.py:1400): the match
  (`init_next_round_input`) returns a device prefix and a host hit (`req.host_hit_length`); the
  budget is checked for the prompt past both (`_select_prefill_admission`, :1603); then, when
  `req.needs_host_load_back()`, with the match's host copy pinned (`_lock_node(lock_host=True)`),
  `tree_cache.init_load_back` (unified_radix_cache.py:3586) allocates device pages for the host
  part (evicting if needed) and queues the copy; a load it declines (fewer than
  `load_back_threshold` tokens, no room) is re-admitted without the host hit (:1548); the loaded
  tokens join the prefix (`req.prefix_len += host_loaded_length`, `cache_protected_len`). An
  admission that passed the budget check always has room for its load (the check asks for the
  prompt past the device hit, its decode tokens and a page, of the same free and evictable pages
  the load evicts from), so a load is declined only under the threshold, before it evicts anything,
  and a refused admission changes nothing (the subject does not declare `evicts_before_admit`);
- `get_new_batch_prefill` (scheduler.py:4353): `ready_to_load_host_cache()` starts the queued
  loads, and the forward pass waits for each layer (`LayerDoneCounter.wait_until`);
- result processing ends with `flush_pending_backups()` (scheduler.py:5106): the backups queued by
  this batch's inserts (checkpoint, release) are submitted.

Where the adapter differs: SGLang reaps a finished transfer's ack at the next step's top; on this
box the copy has finished inside the call that started it (the "direct" copy on a CPU stream is
synchronous), and the adapter reaps it at the end of that call (`check_hicache_events`, SGLang's
own), so that between the driver's operations no node is pinned by a finished transfer (the judge
counts a lock no request holds as a leak). The host tier is therefore never seen with a load in
flight, and the subject does not declare `external_kv`: the call-level driver has no outside
store, and that capability's events (an asynchronous load, an abort while it loads) need a load
that outlives the step. Its own rare states are `HICACHE_EVENTS`.

Two stand-ins, each for a primitive that exists only on an accelerator, installed only while this
subject's calls run (`_sglang`):
- the host pool's buffer is allocated by SGLang's own `alloc_with_host_register` with
  `pin_memory=False`: pinning (cudaHostRegister, pool_host/common.py:349) page-locks host memory
  for DMA and needs CUDA; no device reads it here, and the buffer is the same tensor;
- `transfer_kv_direct` (bound in pool_host/mha.py only on CUDA, HIP and XPU, from sgl_kernel's
  kvcacheio, which is not installed here): sgl_kernel's op is a host loop that copies, for each
  layer, each page of `src_indices` to the page of `dst_indices` with `Tensor.copy_`; `_copy_pages`
  does that copy token by token with tensor indexing (the same copy where each page's indices run
  contiguously, as the paged allocator and the host pool hand them out).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
from array import array
from typing import Any, Dict, FrozenSet, Iterator, List, Sequence, Tuple

from kvledger.engine.ledger.invariants import prefix_hashes
from kvledger.properties.subject import DriverMismatch, SubjectConfig, View
from kvledger.subjects.edits import SourceEdit, bind_to_instances
from kvledger.subjects.sglang import FULL_INDEX, load
from kvledger.subjects.sglang_hicache_zoo import CACHE_CONTROLLER, HOST_MHA, HOST_POOL_COMMON, ZOO
from kvledger.subjects.sglang_import import PACKAGE, VERSION, SglangNames
from kvledger.subjects.sglang_paged import PagedSglangSubject

__all__ = ["HICACHE_ARGS", "HICACHE_EVENTS", "MIN_PAGE_SIZE", "NAME", "VERSION", "ZOO", "HiCacheSglangSubject"]

NAME = "sglang:hicache"
MIN_PAGE_SIZE = 2  # sglang:paged's memory check and retraction
# the deployment's ServerArgs (the hicache_* options of server_args.py)
HICACHE_ARGS: Dict[str, Any] = {
    "enable_hierarchical_cache": True,
    "hicache_ratio": 2.0,
    "hicache_io_backend": "direct",
    "hicache_mem_layout": "layer_first",
    "hicache_write_policy": "write_through",
    "attention_backend": "torch_native",
}
LAYERS = 2  # the device pool's layers: a copy must move each of them
LOADED = "hicache: a prefix loaded back from host"
KEPT_ON_HOST = "hicache: evicted from device, kept on host"
BOTH_TIERS = "hicache: a hit on device continued on host"
HOST_EVICTED = "hicache: a prefix kept on host only evicted from host"
HICACHE_EVENTS: FrozenSet[str] = frozenset({LOADED, KEPT_ON_HOST, BOTH_TIERS, HOST_EVICTED})


def probe(path: str | None = None) -> Tuple[bool, str, str]:
    return PACKAGE.probe()


def build(config: SubjectConfig, path: str | None = None, edits: Sequence[SourceEdit] = ()) -> "HiCacheSglangSubject":
    PACKAGE.no_path(path)
    if config.page_size < MIN_PAGE_SIZE:
        raise ValueError(f"{NAME}: page size {config.page_size}, the spec is page size >= {MIN_PAGE_SIZE}")
    return HiCacheSglangSubject(config, load(), edits)


def _server_args(page_size: int) -> Any:
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path="dummy", device="cpu", page_size=page_size, **HICACHE_ARGS)


def _copy_pages(
    src_layers: Sequence[Any], dst_layers: Sequence[Any], src_indices: Any, dst_indices: Any, page_size: int
) -> None:
    """sgl_kernel's `transfer_kv_direct`: layer by layer, the KV at `src_indices` to `dst_indices`."""
    if len(src_layers) != len(dst_layers) or src_indices.numel() != dst_indices.numel():
        raise ValueError("transfer_kv_direct: layers or indices of different lengths")
    if src_indices.numel() % page_size:
        raise ValueError("transfer_kv_direct: indices are not whole pages")
    src, dst = src_indices.cpu().long(), dst_indices.cpu().long()
    for src_layer, dst_layer in zip(src_layers, dst_layers):
        dst_layer[dst] = src_layer[src]


def _unpinned(alloc: Any) -> Any:
    def allocate(dims: tuple, dtype: Any, device: str, pin_memory: bool, allocator: Any, **registration: Any) -> Any:
        return alloc(dims, dtype, device, False, allocator, **registration)

    return allocate


class HiCacheSglangSubject(PagedSglangSubject):
    """sglang:paged with a host tier: write-through backups, eviction to host, load-back on a hit."""

    name = NAME
    rare_events = HICACHE_EVENTS

    def __init__(self, config: SubjectConfig, s: SglangNames, edits: Sequence[SourceEdit] = ()) -> None:
        from sglang.srt.runtime_context import create_context

        self.server_args = _server_args(config.page_size)
        self._runtime = create_context(self.server_args, role="scheduler")
        self.reached: List[str] = []  # rare states reached since the driver last looked
        self.landed: List[Tuple[int, int, int]] = []  # (location, prefix hash, length) a load filled
        # the ids of the tree's nodes whose KV is on host only, and of those whose KV is on device
        self._host_only: set[int] = set()
        self._on_device: set[int] = set()
        # edits of the host tier's controller and host pool, bound on this subject's own
        host_side = [e for e in edits if e.target.split(":")[0] in (CACHE_CONTROLLER, HOST_MHA)]
        with self._sglang(constructing=True):
            super().__init__(config, s, [e for e in edits if e not in host_side])
            self.controller = self.tree.cache_controller
            bind_to_instances(host_side, [self.controller, self.controller.mem_pool_host.anchor_entry.host_pool], NAME)

    @contextlib.contextmanager
    def _sglang(self, constructing: bool = False) -> Iterator[None]:
        """This subject's runtime context and stand-ins, for the length of one call."""
        from sglang.srt.runtime_context import use_context

        mha: Any = importlib.import_module(HOST_MHA)
        common = importlib.import_module(HOST_POOL_COMMON)
        # where SGLang bound its own (an accelerator's build), it is left in place
        copy = "transfer_kv_direct" not in vars(mha)
        unpinned = constructing and "cpu" not in common.ALLOC_MEMORY_FUNCS
        if copy:
            mha.transfer_kv_direct = _copy_pages
        if unpinned:
            common.ALLOC_MEMORY_FUNCS["cpu"] = _unpinned(common.alloc_with_host_register)
        try:
            with use_context(self._runtime):
                yield
        finally:
            if unpinned:
                del common.ALLOC_MEMORY_FUNCS["cpu"]
            if copy:
                delattr(mha, "transfer_kv_direct")

    # -- what is built differently ------------------------------------------------------------------
    def build_allocator(self, config: SubjectConfig) -> Any:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        torch, ps = self.s.torch, config.page_size
        # ModelRunner's device KV pool, small and real: the host tier copies from and into it
        self.kv = MHATokenToKVPool(
            size=config.num_pages * ps,
            page_size=ps,
            dtype=torch.int64,
            head_num=1,
            head_dim=1,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
        )
        return self.s.PagedTokenToKVPoolAllocator(
            config.num_pages * ps, page_size=ps, dtype=torch.int64, device="cpu", kvcache=self.kv, need_sort=False
        )

    def build_tree(self, config: SubjectConfig) -> Any:
        # registry.create_unified_radix_cache: the tree, then init_hicache (registry.py:193)
        params = self.cache_init_params(config)
        tree = self.s.UnifiedRadixCache(params)
        tree.init_hicache(self.server_args, params)
        # init_hicache registers the tree's storage detach to run at exit; with no storage backend
        # it does nothing, and the registration would keep every subject a long fuzz builds alive
        atexit.unregister(tree.shutdown)
        return tree

    # -- the scheduler's hicache calls ---------------------------------------------------------------
    def begin(self, kind: str, uid: int, call: str) -> bool:
        state = self.scheduler
        if state.step != kind or (uid, call) in state._calls:
            # a new step: get_next_batch_to_run -> _process_hicache_events before the stash
            self.tree.check_hicache_events()
        return super().begin(kind, uid, call)

    def _reap(self) -> None:
        """check_hicache_events for the transfers this call finished, and the host-only nodes."""
        self.tree.check_hicache_events()
        nodes = list(self._nodes())
        host_only = {node.id for node in nodes if _host_only(node)}
        if host_only & self._on_device:
            self.reached.append(KEPT_ON_HOST)
        if self._host_only - {node.id for node in nodes}:  # gone from the tree: evicted from host
            self.reached.append(HOST_EVICTED)
        self._host_only = host_only
        self._on_device = {node.id for node in nodes if node.component_data[FULL_INDEX].value is not None}

    def _nodes(self) -> Iterator[Any]:
        stack = list(self.tree.root_node.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def admit(self, uid: int, budget: int) -> int | None:
        with self._sglang():
            try:
                return self._admit(uid, budget)
            finally:
                self._reap()

    def _admit(self, uid: int, budget: int) -> int | None:
        r = self.requests[uid]
        if r.phase != "waiting":
            raise DriverMismatch(f"uid {uid}: admitted while {r.phase}")
        self.begin("prefill", uid, "admit")
        req = r.req
        unallocated = sum(1 for o in self.requests.values() if o.phase == "admitted" and not o.req.kv.holds_kv)
        if self.req_to_token_pool.available_size() - unallocated <= 0 or budget <= 0:
            return None
        req.init_next_round_input(self.tree)
        max_new = self.scheduler.max_new(req)
        total_tokens = len(req.full_untruncated_fill_ids) - req.prefix_len + max_new + self.page_size
        pin = self.tree.lock(req.last_node)
        try:
            if not self._fits(req, req.host_hit_length, total_tokens, max_new, budget):
                return None
            device_hit = req.prefix_len
            if req.needs_host_load_back():
                loaded = self._load_back(req)
                if loaded < req.host_hit_length and not self._fits(req, 0, total_tokens, max_new, budget):
                    return None
                if loaded:
                    self._landed(req, device_hit)
            extend = len(req.full_untruncated_fill_ids) - req.prefix_len
            chunk = min(extend, budget)
            req.extend_end = req.prefix_len + chunk
            req.lock = self.tree.lock(req.last_node)
        finally:
            self.tree.unlock(pin)
        self.scheduler.reserve(uid, chunk, max_new if chunk == extend else 0)
        self._admissions += 1
        r.phase, r.order = "admitted", self._admissions
        return int(req.prefix_len)

    def _fits(self, req: Any, host_hit: int, total_tokens: int, max_new: int, budget: int) -> bool:
        """PrefillAdder._select_prefill_admission's budget check, for the prompt past the hit."""
        fits, _ = self.scheduler.prefill_budget(self.allocator, self.tree, self._running()).check_prefill(
            extend_input_len=len(req.full_untruncated_fill_ids) - req.prefix_len - host_hit,
            total_tokens=total_tokens,
            max_new_tokens=max_new,
            input_tokens=len(req.full_untruncated_fill_ids),
            swa_host_hit_length=0,
            chunk_limit=budget,
        )
        if not fits and not any(o.phase in ("admitted", "running") for o in self.requests.values()):
            self.scheduler.ratio.reset()  # the event loop's on_idle, as sglang.py's admit
        return bool(fits)

    def _load_back(self, req: Any) -> int:
        """add_one_req's load-back (schedule_policy.py:1469-1547) and the prefill batch's start of
        the loads (scheduler.py:4353), then the forward pass's wait for each layer."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        tree = self.tree
        node = req.best_match_node
        host_pin = tree.inc_host_lock_ref(node).to_dec_params()
        pin = tree.lock(node)
        try:
            promised = req.host_hit_length
            loaded, last_node = tree.init_load_back(
                InitLoadBackParams(best_match_node=node, host_hit_length=promised, req=req)
            )
        finally:
            tree.unlock(pin)
            tree.dec_host_lock_ref(node, host_pin)
        req.host_loaded_length, req.last_node = loaded, last_node
        if 0 < loaded < promised:  # add_one_req's own check (schedule_policy.py:1527)
            raise RuntimeError(f"HiCache load-back must commit all promised tokens or none: {loaded} of {promised}")
        req.prefix_len += loaded
        if tree.load_back_is_cache_owned():
            req.kv.cache_protected_len = req.prefix_len
        consumer = tree.ready_to_load_host_cache()
        counter = self.controller.layer_done_counter
        counter.set_consumer(consumer)
        for layer in range(LAYERS):
            counter.wait_until(layer)
        return int(loaded)

    def _landed(self, req: Any, device_hit: int) -> None:
        """What the load put in the device KV buffer, read from it, position by position."""
        locations = self.tree.prefix_device_indices(req)[device_hit : req.prefix_len].tolist()
        for loc in locations:
            keys = {int(self.kv.k_buffer[layer][loc].flatten()[0]) for layer in range(LAYERS)}
            lengths = {int(self.kv.v_buffer[layer][loc].flatten()[0]) for layer in range(LAYERS)}
            if len(keys) == 1 and len(lengths) == 1:
                self.landed.append((int(loc), keys.pop(), lengths.pop()))
            else:  # the layers disagree: KV of no one prefix
                self.landed.append((int(loc), hash((tuple(sorted(keys)), tuple(sorted(lengths)))), 0))
        self.reached.append(LOADED)
        if device_hit:
            self.reached.append(BOTH_TIERS)

    # -- the forward pass and the result processing --------------------------------------------------
    def computed(self, uid: int, start: int, end: int, token: int | None) -> None:
        with self._sglang():
            req = self.requests[uid].req
            tokens = [*req.origin_input_ids, *req.output_ids][:end]
            if len(tokens) != end or not req.kv.holds_kv:
                raise DriverMismatch(f"uid {uid}: computed [{start}, {end}) of {len(tokens)} tokens")
            self._write_kv(req, tokens, start, end)
            super().computed(uid, start, end, token)
            self.tree.flush_pending_backups()  # the end of process_batch_result (scheduler.py:5106)
            self._reap()

    def _write_kv(self, req: Any, tokens: Sequence[int], start: int, end: int) -> None:
        """The forward pass: each position's KV is the hash of the prefix it encodes."""
        torch = self.s.torch
        locations = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:end].long()
        keys = torch.tensor(prefix_hashes(tokens)[start:end], dtype=torch.int64)
        lengths = torch.arange(start + 1, end + 1, dtype=torch.int64)
        for layer in range(LAYERS):
            self.kv.k_buffer[layer][locations] = keys.view(-1, 1, 1)
            self.kv.v_buffer[layer][locations] = lengths.view(-1, 1, 1)

    def submit(self, uid: int, prompt: Sequence[int], max_tokens: int) -> None:
        with self._sglang():
            super().submit(uid, array("q", [int(t) for t in prompt]), max_tokens)

    def allocate(self, uid: int, start: int, end: int) -> bool:
        with self._sglang():
            try:
                return super().allocate(uid, start, end)
            finally:
                self._reap()

    def finish(self, uid: int) -> None:
        with self._sglang():
            super().finish(uid)
            self.tree.flush_pending_backups()
            self._reap()

    def abort(self, uid: int) -> None:
        with self._sglang():
            super().abort(uid)
            self._reap()

    def preempt(self, uid: int) -> None:
        with self._sglang():
            super().preempt(uid)
            self._reap()

    def evict(self, tokens: int) -> int:
        with self._sglang():
            try:
                return super().evict(tokens)
            finally:
                self._reap()

    def view(self) -> View:
        """sglang.py's view of the device pool; a node whose KV is on host only holds no device
        location and is not an entry of it (the host tier is judged by what a load puts back)."""
        with self._sglang():
            view = super().view()
            on_host = {f"node {node.id}" for node in self._nodes() if _host_only(node)}
        view.cached = [e for e in view.cached if not (e.name in on_host and not e.locations)]
        return view


def _host_only(node: Any) -> bool:
    """A node whose device KV was evicted and whose host copy stays."""
    data = node.component_data[FULL_INDEX]
    return data.value is None and data.host_value is not None
