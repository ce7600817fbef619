"""SGLang's tree cache and paged KV allocator (the installed sglang 0.5.23) as a kvledger subject.

Two specs, each a tree cache over a `PagedTokenToKVPoolAllocator` (`TokenToKVPoolAllocator` at
page size 1, as `kv_cache_configurator.py` picks) and a `ReqToTokenPool`:
  sglang        the tree the scheduler builds by default in 0.5.23: `UnifiedRadixCache` with
                tree_components (FULL,) (`mem_cache/registry.py:default_radix_cache_factory` ->
                `create_unified_radix_cache`, line 149), on its Python tree core (`UnifiedTreeCore`:
                the Rust core, SGLang's default backend, implements the same interface in a compiled
                extension that no source edit can reach and whose nodes cannot be read one by one;
                the Python core is the fallback `tree_core_registry.resolve_tree_core_backend` picks)
  sglang:radix  the classic `RadixCache` (`radix_cache.py`), which `PureSWARadixCache` and FlexKV
                build on, and which shares the checkpoint/release path
Both are driven with real `sglang.srt.managers.schedule_batch.Req` objects through SGLang's own
scheduler functions: `Req.init_next_round_input` (match), the `PrefillAdder` arithmetic
(`managers/schedule_policy.py`, `add_one_req` over `mem_cache/prefill_budget.py:PrefillBudget`),
`alloc_for_extend` / `alloc_for_decode` (`mem_cache/allocation.py`, on a `ScheduleBatch`),
`checkpoint_kv_cache` / `release_kv_cache` (`mem_cache/common.py`). No model, no GPU, no scheduler
process. `sglang_paged.py` builds `sglang:paged` on this class (page size > 1, the decode memory
check and retract_decode).

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

The adapter's other parts: `sglang_import.py` imports SGLang's cache without its side effects,
`sglang_scheduler.py` keeps what the scheduler keeps between calls (the step, the prefill pass's
reservations, the new-token ratio), `sglang_zoo.py` holds the planted bugs.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import types
from array import array
from typing import Any, Callable, Dict, Hashable, List, Sequence, Tuple

from kvledger.properties.subject import CachedEntry, Capabilities, DriverMismatch, SubjectConfig, View
from kvledger.subjects.edits import EditError, SourceEdit, bind, edited_function
from kvledger.subjects.sglang_import import ALLOCATION, COMMON, PACKAGE, VERSION, SglangNames
from kvledger.subjects.sglang_scheduler import SchedulerState, SglangRequest
from kvledger.subjects.sglang_zoo import CHUNK_ZOO, RADIX_ZOO, UNIFIED_ZOO

__all__ = [
    "NAME",
    "VERSION",
    "FUNCTIONS",
    "ZOO",
    "ZOOS",
    "RadixSglangSubject",
    "SglangSubject",
    "build",
    "build_spec",
    "load",
    "probe",
]

log = logging.getLogger(__name__)

NAME = "sglang"
RADIX = "sglang:radix"
ZOO = UNIFIED_ZOO + CHUNK_ZOO  # the default spec's: its tree, then chunked prefill's checkpoint and abort
ZOOS = {NAME: ZOO, RADIX: RADIX_ZOO}
# the UnifiedRadixCache's tree core (CacheInitParams.tree_core_backend): the Python one, whose
# nodes the view reads and whose source the zoo edits (see the module docstring)
TREE_CORE_BACKEND = "python"
FULL_INDEX = 0  # ComponentType.FULL, the index of a UnifiedTreeNode's full-attention component data
# The module functions this adapter calls (the scheduler's calls). An edit of one of them is
# compiled once and called in its place, by this subject alone (`SglangSubject.functions`).
FUNCTIONS: Tuple[str, ...] = (
    f"{COMMON}:checkpoint_kv_cache",
    f"{COMMON}:release_kv_cache",
    f"{COMMON}:evict_from_tree_cache",
    f"{ALLOCATION}:alloc_for_extend",
    f"{ALLOCATION}:alloc_for_decode",
)


def load() -> SglangNames:
    """Import SGLang's cache modules the way this adapter does (cache directories, the torchvision
    stand-in), so that `edits.edited_function` can find an edit's target; SubjectUnavailable when
    it cannot."""
    return PACKAGE.load()


def probe(path: str | None = None) -> Tuple[bool, str, str]:
    return PACKAGE.probe()


def build(config: SubjectConfig, path: str | None = None, edits: Sequence[SourceEdit] = ()) -> "SglangSubject":
    PACKAGE.no_path(path)
    return SglangSubject(config, load(), edits)


def build_spec(config: SubjectConfig, name: str, edits: Sequence[SourceEdit] = ()) -> "SglangSubject":
    """`sglang` or `sglang:radix`."""
    if name == RADIX:
        return RadixSglangSubject(config, load(), edits)
    if name != NAME:
        raise ValueError(f"{name}: not a spec of {__name__} ({NAME}, {RADIX})")
    return SglangSubject(config, load(), edits)


class SglangSubject:
    """One tree cache, its allocator and request table, and the live `Req`s, driven as SGLang's
    `Scheduler` drives them. Subclasses change what is built through the `build_*` methods
    (`tree_components`, `cache_init_params`) and keep the protocol's calls."""

    name = NAME

    def __init__(self, config: SubjectConfig, s: SglangNames, edits: Sequence[SourceEdit] = ()) -> None:
        self.s = s
        self.version = importlib.metadata.version("sglang")
        self.page_size = config.page_size
        # what the scheduler process builds at start (ModelRunner: the pools and the allocator;
        # kv_cache_builder -> registry.create_tree_cache: the tree), each in a method of its own
        self.req_to_token_pool = self.build_req_to_token_pool(config)
        self.allocator = self.build_allocator(config)
        self.tree = self.build_tree(config)
        # ScheduleBatch reads two fields of the model config on this path
        self._model_config = types.SimpleNamespace(vocab_size=1 << 31, is_encoder_decoder=False)
        self.scheduler = self.build_scheduler_state()
        self.requests: Dict[int, SglangRequest] = {}
        # a middle chunk computed in the last step, checkpointed at the top of the next one
        # (Scheduler.get_next_batch_to_run -> stash_chunked_request), unless aborted first
        self.chunk_to_stash: int | None = None
        self._admissions = 0
        self.functions: Dict[str, Callable] = {
            t: getattr(importlib.import_module(t.split(":")[0]), t.split(":")[1]) for t in FUNCTIONS
        }
        self._req_edits, self._batch_edits = bind_edits(self, edits)
        self.capabilities = self.build_capabilities(config)

    # -- construction, one overridable part each -----------------------------------------------------
    def build_req_to_token_pool(self, config: SubjectConfig) -> Any:
        # ModelRunner sizes rows at the model's context length + 4 (kv_cache_configurator,
        # extra_max_context_len); here max_seq_len is that context length
        return self.s.ReqToTokenPool(
            size=config.max_running_req, max_context_len=config.max_seq_len + 4, device="cpu", enable_memory_saver=False
        )

    def build_allocator(self, config: SubjectConfig) -> Any:
        # dtype and kvcache size KV tensors the allocator never touches here; need_sort is for
        # disaggregation only (kv_cache_configurator)
        ps, torch = config.page_size, self.s.torch
        if ps == 1:
            return self.s.TokenToKVPoolAllocator(
                config.num_pages, dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=False
            )
        return self.s.PagedTokenToKVPoolAllocator(
            config.num_pages * ps, page_size=ps, dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=False
        )

    def cache_init_params(self, config: SubjectConfig) -> Any:
        """What `kv_cache_builder` hands `registry.create_tree_cache` (CacheInitParams), with the
        tree's components: FULL alone for a full-attention model (`create_unified_radix_cache`)."""
        return self.s.CacheInitParams(
            disable=False,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=config.page_size,
            tree_components=self.tree_components(),
            tree_core_backend=TREE_CORE_BACKEND,
        )

    def tree_components(self) -> Tuple[Any, ...]:
        return (self.s.ComponentType.FULL,)

    def build_tree(self, config: SubjectConfig) -> Any:
        # registry.default_radix_cache_factory -> create_unified_radix_cache (registry.py:149)
        return self.s.UnifiedRadixCache(self.cache_init_params(config))

    def build_scheduler_state(self) -> SchedulerState:
        return SchedulerState(self.s)

    def build_capabilities(self, config: SubjectConfig) -> Capabilities:
        return Capabilities(
            page_size=config.page_size,
            pages=tuple(range(1, config.num_pages + 1)),
            worst_case_admission=False,
            preempts=True,
            explicit_evict=True,
            cached_pages_in_free_pool=False,
            chunked_prefill=True,
            prefill_publishes_to_cache=True,
            # PrefillAdder.add_one_req asks for the rest of the prompt, its decode tokens and a page
            admission_margin=True,
        )

    def begin(self, kind: str, uid: int, call: str) -> bool:
        """A call of a scheduling step; at the top of a new one, Scheduler.get_next_batch_to_run
        (scheduler.py:3894) first runs process_pending_chunked_abort (this adapter's `abort` did:
        it comes between steps), then stashes the chunked request: checkpoint_kv_cache of the chunk
        the last step computed (stash_chunked_request, :3772, when extend_end > prefix_len)."""
        if not self.scheduler.begin(kind, uid, call):
            return False
        if self.chunk_to_stash is not None:
            req = self.requests[self.chunk_to_stash].req
            self.chunk_to_stash = None
            self.functions[f"{COMMON}:checkpoint_kv_cache"](req, self.tree)
        return True

    def _running(self) -> List[SglangRequest]:
        return sorted((r for r in self.requests.values() if r.phase == "running"), key=lambda r: r.order)

    def _available_and_evictable(self) -> int:
        return self.allocator.available_size() + self.tree.evictable_size()

    def _batch(self, req: Any) -> Any:
        return self.batch_of([req])

    def batch_of(self, reqs: Sequence[Any]) -> Any:
        """A ScheduleBatch of `reqs` (ScheduleBatch.init_new, as get_new_batch_prefill and the
        running batch build it), with this subject's ScheduleBatch edits bound on it."""
        batch = self.s.ScheduleBatch.init_new(
            list(reqs), self.req_to_token_pool, self.allocator, self.tree, self._model_config, False, self.s.NONE
        )
        if self._batch_edits:
            bind(batch, self._batch_edits)
        return batch

    # -- the protocol --------------------------------------------------------------------------
    def submit(self, uid: int, prompt: Sequence[int], max_tokens: int) -> None:
        # TokenizerManager: SamplingParams.normalize; Scheduler.handle_generate_request builds the Req
        params = self.s.SamplingParams(max_new_tokens=max_tokens)
        params.normalize(None)
        req = self.s.Req(str(uid), "", array("q", [int(t) for t in prompt]), params, vocab_size=1 << 31)
        if self._req_edits:
            bind(req, self._req_edits)
        self.requests[uid] = SglangRequest(req)

    def admit(self, uid: int, budget: int) -> int | None:
        r = self.requests[uid]
        if r.phase != "waiting":
            raise DriverMismatch(f"uid {uid}: admitted while {r.phase}")
        self.begin("prefill", uid, "admit")
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
        max_new = self.scheduler.max_new(req)
        extend = len(req.full_untruncated_fill_ids) - req.prefix_len
        total_tokens = extend + max_new + self.page_size
        pin = self.tree.lock(req.last_node)
        try:
            fits, _ = self.scheduler.prefill_budget(self.allocator, self.tree, self._running()).check_prefill(
                extend_input_len=extend,
                total_tokens=total_tokens,
                max_new_tokens=max_new,
                input_tokens=len(req.full_untruncated_fill_ids),
                swa_host_hit_length=0,
                chunk_limit=budget,
            )
            if not fits:
                log.debug("sglang: uid %d refused (hit %d, %d tokens wanted)", uid, req.prefix_len, total_tokens)
                if not any(o.phase in ("admitted", "running") for o in self.requests.values()):
                    # no batch to run: the event loop's on_idle (scheduler.py:2053) resets the
                    # new-token ratio (new_token_ratio_tracker.reset(), :5318) before it tries again
                    self.scheduler.ratio.reset()
                return None
            chunk = min(extend, budget)
            req.extend_end = req.prefix_len + chunk
            req.lock = self.tree.lock(req.last_node)
        finally:
            self.tree.unlock(pin)
        # a chunked admission reserves no decode tokens (is_chunked: max_new_tokens = 0)
        self.scheduler.reserve(uid, chunk, max_new if chunk == extend else 0)
        self._admissions += 1
        r.phase, r.order = "admitted", self._admissions
        return req.prefix_len

    def allocate(self, uid: int, start: int, end: int) -> bool:
        r = self.requests[uid]
        if r.phase == "running":
            return self._allocate_decode(uid, r.req, start, end)
        if r.phase != "admitted":
            raise DriverMismatch(f"uid {uid}: allocate while {r.phase}")
        return self._allocate_extend(uid, r.req, start, end)

    def _allocate_decode(self, uid: int, req: Any, start: int, end: int) -> bool:
        # Scheduler.update_running_batch: check_decode_mem, then prepare_for_decode ->
        # alloc_for_decode(batch, token_per_req=1), one request at a time here
        torch = self.s.torch
        self.begin("decode", uid, "allocate")
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
            self.scheduler.retry(uid, "allocate")
            return False
        self.functions[f"{ALLOCATION}:alloc_for_decode"](batch, 1)
        return True

    def _allocate_extend(self, uid: int, req: Any, start: int, end: int) -> bool:
        torch = self.s.torch
        self.begin("prefill", uid, "allocate")
        if start != req.prefix_len or end <= start or end > len(req.full_untruncated_fill_ids):
            raise DriverMismatch(
                f"uid {uid}: allocate [{start}, {end}) with {req.prefix_len} positions computed "
                f"of {len(req.full_untruncated_fill_ids)}"
            )
        if uid not in self.scheduler.reservations:
            # the request mid-prefill: PrefillAdder.add_chunked_req reserves its next chunk, and
            # its decode tokens when the chunk ends the prompt
            done = end == len(req.full_untruncated_fill_ids)
            self.scheduler.reserve(uid, end - start, self.scheduler.max_new(req) if done else 0)
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
            self.scheduler.retry(uid, "allocate")
            return False
        # ScheduleBatch.prepare_for_extend sets these, then calls alloc_for_extend(self)
        batch = self._batch(req)
        batch.prefix_lens, batch.extend_lens = [req.prefix_len], [req.extend_len]
        batch.seq_lens = batch.seq_lens_cpu = torch.tensor([end], dtype=torch.int64)
        batch.extend_num_tokens = req.extend_len
        self.functions[f"{ALLOCATION}:alloc_for_extend"](batch)
        req.is_retracted = False
        self.scheduler.took(uid, int(new_pages) * ps)
        return True

    def computed(self, uid: int, start: int, end: int, token: int | None) -> None:
        r = self.requests[uid]
        req = r.req
        self.scheduler.step = None
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
            # a middle chunk: process_batch_result_prefill leaves it to the next step's top
            # (`begin`: stash_chunked_request -> checkpoint_kv_cache)
            if end >= len(req.full_untruncated_fill_ids):
                raise DriverMismatch(f"uid {uid}: the prompt's last chunk came without a token")
            self.chunk_to_stash = uid
            return
        # process_batch_result_prefill: append the token, update_finish_state; a request that goes
        # on is checkpointed now, one that finished (max_new_tokens reached) is released by finish
        if end != len(req.full_untruncated_fill_ids):
            raise DriverMismatch(f"uid {uid}: a token after [{start}, {end}) of {len(req.full_untruncated_fill_ids)}")
        req.output_ids.append(int(token))
        req.update_finish_state()
        r.phase = "running"
        if not req.finished():
            self.functions[f"{COMMON}:checkpoint_kv_cache"](req, self.tree)

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
        self.functions[f"{COMMON}:release_kv_cache"](req, self.tree, checkpoint=True)
        self.scheduler.idle(len(self.requests))

    def abort(self, uid: int) -> None:
        r = self.requests.pop(uid)
        req = r.req
        if r.phase == "running":
            # Scheduler.abort_request, method 3: to_finish = FINISH_ABORT, and the request leaves
            # through the finish path (release_kv_cache(checkpoint=True)); SGLang first runs one more
            # decode step for it, whose token is dropped
            req.finished_reason = self.s.FINISH_ABORT()
            self.functions[f"{COMMON}:release_kv_cache"](req, self.tree, checkpoint=True)
        elif r.phase == "admitted":
            # process_pending_chunked_abort: release_kv_cache(checkpoint=False). Admitted but not
            # yet allocated (a window SGLang's scheduler does not have): only its match lock
            self._release(uid, req)
        # waiting: abort method 1, popped from the queue, it holds nothing
        self.scheduler.forget(uid)
        self.scheduler.idle(len(self.requests))

    def preempt(self, uid: int) -> None:
        # ScheduleBatch.retract_decode -> release_req: release_kv_cache(checkpoint=False), evict what
        # the remaining requests' next SGLANG_RETRACT_DECODE_STEPS decode steps need, reset_for_retract
        # (it keeps its output tokens: its next admission's prompt is origin + output); then the
        # scheduler sets new_token_ratio from the requests still running
        r = self.requests[uid]
        if r.phase == "waiting":
            raise DriverMismatch(f"uid {uid}: preempt of a waiting request")
        req = r.req
        self._release(uid, req)
        remaining = [o for o in self._running() if o is not r]
        steps = self.scheduler.retract_decode_steps
        self.functions[f"{COMMON}:evict_from_tree_cache"](self.tree, len(remaining) * steps)
        req.reset_for_retract()
        r.phase = "waiting"
        self.scheduler.forget(uid)
        self.scheduler.after_retract(remaining)

    def _release(self, uid: int, req: Any) -> None:
        # a chunk computed and not yet stashed is never checkpointed: process_pending_chunked_abort
        # runs before the stash (get_next_batch_to_run), and a retraction releases without one
        if self.chunk_to_stash == uid:
            self.chunk_to_stash = None
        if req.kv.holds_kv:
            self.functions[f"{COMMON}:release_kv_cache"](req, self.tree, checkpoint=False)
        else:
            self.tree.unlock(req.lock)
            req.lock = None

    def evict(self, tokens: int) -> int:
        return int(self.tree.evict(self.s.EvictParams(num_tokens=tokens)).num_tokens_evicted)

    def view(self) -> View:
        return read_view(self)

    def cache_key(self, tokens: Sequence[int]) -> Hashable:
        return tuple(int(t) for t in tokens)  # a radix tree files by path; the judge never asks


class RadixSglangSubject(SglangSubject):
    """`sglang:radix`: the classic RadixCache (`radix_cache.py`) in the default tree's place."""

    name = RADIX

    def build_tree(self, config: SubjectConfig) -> Any:
        return self.s.RadixCache(
            self.s.CacheInitParams(
                disable=False,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.allocator,
                page_size=config.page_size,
            )
        )


def bind_edits(subject: SglangSubject, edits: Sequence[SourceEdit]) -> Tuple[List[SourceEdit], List[SourceEdit]]:
    """Bind a method edit on the objects of `subject` that run it (the tree, its tree core and
    components, the allocator, the request table); a module function edit replaces the function
    the subject calls. The edits of `Req`'s and `ScheduleBatch`'s methods are returned: the subject
    binds them on every Req and every batch it creates."""
    owners = [subject.tree, subject.allocator, subject.req_to_token_pool]
    if hasattr(subject.tree, "tree_core"):
        owners += [subject.tree.tree_core, *subject.tree.components.values()]
    req_edits: List[SourceEdit] = []
    batch_edits: List[SourceEdit] = []
    for edit in edits:
        module_name, path = edit.split()
        if len(path) == 1:
            if edit.target not in subject.functions:
                raise EditError(
                    f"{edit.name}: {edit.target} is not a function this adapter calls ({', '.join(FUNCTIONS)})"
                )
            subject.functions[edit.target] = edited_function(edit)
            continue
        owner_class: Any = importlib.import_module(module_name)
        for part in path[:-1]:
            owner_class = getattr(owner_class, part, None)
        if not isinstance(owner_class, type):
            raise EditError(f"{edit.name}: {edit.target.rpartition('.')[0]} is not a class")
        per_object = {subject.s.Req: req_edits, subject.s.ScheduleBatch: batch_edits}
        made = next((kept for cls, kept in per_object.items() if issubclass(cls, owner_class)), None)
        if made is not None:
            edited_function(edit)  # EditError now rather than at the first use
            made.append(edit)
            continue
        found = [o for o in owners if isinstance(o, owner_class)]
        if not found and _other_allocator(subject, owner_class):
            # the paged allocator's code at page size 1, where SGLang builds TokenToKVPoolAllocator
            # (kv_cache_configurator): the edited code never runs in this subject
            edited_function(edit)  # EditError still for a text that is not there
            log.debug("sglang: %s edits %s, which a page size 1 subject does not run", edit.name, owner_class.__name__)
            continue
        if not found:
            raise EditError(f"{edit.name}: no object of this subject is a {owner_class.__name__}")
        for owner in found:
            bind(owner, [edit])
    return req_edits, batch_edits


def _other_allocator(subject: SglangSubject, owner_class: type) -> bool:
    """`owner_class` is a KV allocator class other than the subject's own allocator's."""
    base = subject.s.BaseTokenToKVPoolAllocator
    return issubclass(owner_class, base) and not isinstance(subject.allocator, owner_class)


# -- what the judge reads ----------------------------------------------------------------------------
def read_view(subject: SglangSubject) -> View:
    """The subject's request rows, the allocator's free pages, the tree's nodes and the counters
    SGLang keeps, each read from SGLang's own structures."""
    rows = subject.req_to_token_pool.req_to_token
    tree, allocator = subject.tree, subject.allocator
    requests: Dict[int, List[int]] = {}
    for uid, r in subject.requests.items():
        if r.phase in ("waiting", "retracted"):  # retracted: released by retract_decode, not yet requeued
            continue
        req = r.req
        if req.kv.holds_kv:
            # its row up to what it has allocated: [0, kv_allocated_len)
            requests[uid] = rows[req.kv.req_pool_idx, : req.kv.kv_allocated_len].tolist()
        else:
            # admitted, no chunk allocated yet: it holds its locked match, which the first
            # allocation copies into its row (allocation._prefix_kv_indices)
            requests[uid] = tree.prefix_device_indices(req).tolist()
    if isinstance(allocator, subject.s.PagedTokenToKVPoolAllocator):
        free = allocator.free_pages.tolist() + [p for part in allocator.staged_pages for p in part.tolist()]
    else:
        free = allocator.free_pages.tolist() + allocator.release_pages.tolist()
    return View(
        free=free,
        requests=requests,
        cached=tree_entries(tree),
        counters={
            "free_pages": allocator.available_size() // subject.page_size,
            "evictable_tokens": int(tree.evictable_size()),
            "protected_tokens": int(tree.protected_size()),
            "cached_tokens": _full_size(tree.total_size()),
            # what the PrefillAdder counts as room (PrefillBudget._available_and_evictable)
            "available_tokens": int(allocator.create_prefill_budget(tree)._available_and_evictable()),
        },
    )


def _full_size(total: Any) -> int:
    """A RadixCache's total_size is its tokens; a UnifiedRadixCache's is (full, swa)."""
    return int(total[0] if isinstance(total, tuple) else total)


def node_full(node: Any) -> Tuple[Any, int]:
    """A node's full-attention KV locations (a tensor or None) and lock count: a RadixCache node
    keeps them as its own fields, a UnifiedRadixCache node (the Python tree core's
    UnifiedTreeNode) per component, FULL's being the device KV."""
    data = getattr(node, "component_data", None)
    if data is None:
        return node.value, int(node.lock_ref)
    full = data[FULL_INDEX]
    return full.value, int(full.lock_ref)


def tree_entries(tree: Any) -> List[CachedEntry]:
    """One entry per node of the tree, found down the children maps; its tokens are read up its
    own parent pointers, so a node whose links disagree shows a path other than where it hangs.
    A node whose full KV was evicted (value None) holds no location."""
    root = tree.root_node
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
        value, lock = node_full(node)
        locations = tuple(value.tolist()) if value is not None else ()
        entries.append(
            CachedEntry(
                locations=locations,
                start=len(tokens) - len(node.key),
                tokens=tokens,
                lock=lock,
                name=f"node {node.id}",
            )
        )
        stack.extend(node.children.values())
    return entries
