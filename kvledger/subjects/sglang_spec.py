"""`sglang:spec`: SGLang 0.5.23's speculative decoding allocation (NGRAM, spec v2) as a kvledger subject.

The sglang subject (`sglang.py`: the default tree cache, the paged allocator, real `Req`s and
`ScheduleBatch`es) with the scheduler settings of a speculative deployment that runs on a CPU:
`ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4, page_size=4,
attention_backend="torch_native")`, published in a runtime context of this subject's own
(`runtime_context.create_context`, made active around each of its calls with `use_context`), so
the process-wide config the other sglang specs read stays as it was.

A decode step is SGLang's, per request (the driver's decode, `properties/subject_speculation.py`):
- `allocate`: `Scheduler.update_running_batch` asks `ScheduleBatch.check_decode_mem`
  (schedule_batch.py:3432), whose spec estimate `_new_tokens_required_next_decode_spec_v2`
  (:3421) matches the allocation; no room: `retract_decode` (the driver's preempt). Then
  `prepare_for_decode` (:3736) -> `spec_utils.spec_prepare_for_decode` ->
  `eagle_utils.eagle_prepare_for_decode` (:857): `reserve = get_alloc_reserve_per_decode()` =
  2 x 4 (allocation_sizing.py:64), `page_aligned_decode_alloc_lens` (:72) gives
  nxt = max(kv_allocated_len, ceil_page(kv_committed_len + reserve)), and
  `alloc_for_spec_decode` (allocation.py:780) allocates [kv_allocated_len, nxt) and sets
  kv_allocated_len = nxt;
- the verify forward writes KV for the last token and its 3 drafts (NGRAM's verify tree holds
  speculative_num_draft_tokens = 4 tokens, the first the request's last token: spec_tokens 3);
- `computed`: the worker's result, `next_token_ids` padded to the verify width and `accept_lens`
  (drafts kept + the bonus), goes through the scheduler's own
  `SchedulerBatchResultProcessor._resolve_spec_v2_tokens` (batch_result_processor.py:770), which
  does kv_committed_len += the accepted run (:831), then `process_batch_result_decode` (:952)
  extends output_ids and calls update_finish_state;
- release (`finish`, `abort`, `preempt`): `common.release_kv_cache` (common.py:400) frees
  [cache_protected_len, owned_kv_len), then `_release_overallocated_kv_indices` (:447) frees
  [ceil_page(owned_kv_len), kv_allocated_len).

So kv_committed_len = len(tokens) - 1 after each step, and a row reaches
ceil_page(len(tokens) - 1 + reserve): `max_ahead` = reserve - 1. The request table's rows are as
wide as SGLang sizes them under speculation (the model's context length +
`get_req_to_token_extra_context_len()`, allocation_sizing.py:98).

The one stub: `allocation.assign_req_to_token_pool_func` is a Triton kernel (and, on SGLang's CPU
engine, an sgl_kernel op; neither runs here). `_assign_rows` writes the same thing with a torch loop
(each request's row, positions [start, end), from the flat out_cache_loc in batch order), put in
its place while this subject's calls run.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from dataclasses import replace
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

from kvledger.properties.subject import Capabilities, DriverMismatch, SubjectConfig, View
from kvledger.subjects.edits import EditError, SourceEdit, bind, edited_function
from kvledger.subjects.sglang import SglangSubject, load
from kvledger.subjects.sglang_import import ALLOCATION, COMMON, PACKAGE, SglangNames
from kvledger.subjects.sglang_spec_zoo import (
    ALLOCATION_SIZING,
    BATCH_RESULT,
    EAGLE_UTILS,
    RESOLVE,
    SCHEDULE_BATCH_MODULE,
    ZOO,
)

__all__ = ["MIN_PAGE_SIZE", "NAME", "ZOO", "SpecSglangSubject", "build", "probe"]

NAME = "sglang:spec"
# The deployment's settings (field-paths.md section 8: what runs on a CPU)
ALGORITHM = "NGRAM"
NUM_DRAFT_TOKENS = 4  # speculative_num_draft_tokens: the verify tree's tokens, the last token included
PAGE_SIZE = 4
MIN_PAGE_SIZE = PAGE_SIZE  # the driver draws this page size only: the published one
# SGLang's functions on the speculative path that this subject calls or that they call, and the
# modules whose globals name them (one imported by name is replaced there too while the subject
# runs, so an edit of it reaches its callers)
SPEC_FUNCTIONS: Tuple[str, ...] = (
    f"{EAGLE_UTILS}:eagle_prepare_for_decode",
    f"{ALLOCATION}:alloc_for_spec_decode",
    f"{ALLOCATION_SIZING}:page_aligned_decode_alloc_lens",
    f"{COMMON}:_release_overallocated_kv_indices",
)
CALLERS: Tuple[str, ...] = (EAGLE_UTILS, ALLOCATION, ALLOCATION_SIZING, COMMON, SCHEDULE_BATCH_MODULE)


def probe(path: str | None = None) -> Tuple[bool, str, str]:
    return PACKAGE.probe()


def build(config: SubjectConfig, path: str | None = None, edits: Sequence[SourceEdit] = ()) -> "SpecSglangSubject":
    PACKAGE.no_path(path)
    return SpecSglangSubject(config, load(), edits)


_CONTEXTS: Dict[int, Any] = {}


def _context(page_size: int) -> Any:
    """The runtime context of a speculative deployment at `page_size` (one per process and page size)."""
    if page_size not in _CONTEXTS:
        from sglang.srt.runtime_context import create_context
        from sglang.srt.server_args import ServerArgs

        args = ServerArgs(
            model_path="dummy",
            device="cpu",
            speculative_algorithm=ALGORITHM,
            speculative_num_draft_tokens=NUM_DRAFT_TOKENS,
            page_size=page_size,
            attention_backend="torch_native",
        )
        _CONTEXTS[page_size] = create_context(args, role="scheduler")
    return _CONTEXTS[page_size]


def _assign_rows(
    req_pool_indices: Any, req_to_token: Any, start_offset: Any, end_offset: Any, out_cache_loc: Any, batch_size: int
) -> None:
    """What the `assign_req_to_token_pool` kernel writes: row req_pool_indices[i], positions
    [start_offset[i], end_offset[i]), from out_cache_loc taken in batch order."""
    at = 0
    for i in range(batch_size):
        row, start, end = int(req_pool_indices[i]), int(start_offset[i]), int(end_offset[i])
        req_to_token[row, start:end] = out_cache_loc[at : at + end - start]
        at += end - start


class SpecSglangSubject(SglangSubject):
    """The sglang subject under a speculative deployment: decode steps allocate ahead, verify
    drafts and commit the accepted run; releases free the over-allocated tail."""

    name = NAME

    def __init__(self, config: SubjectConfig, s: SglangNames, edits: Sequence[SourceEdit] = ()) -> None:
        if config.page_size != PAGE_SIZE:
            raise DriverMismatch(f"{NAME} runs at page size {PAGE_SIZE}, not {config.page_size}")
        self._runtime = _context(config.page_size)
        spec_edits = [e for e in edits if e.target in SPEC_FUNCTIONS or e.target.endswith(RESOLVE)]
        self._installed: List[Tuple[Any, str, Callable]] = [
            (importlib.import_module(ALLOCATION), "assign_req_to_token_pool_func", _assign_rows)
        ]
        with self._sglang():
            super().__init__(config, s, [e for e in edits if e not in spec_edits])
            self.spec_functions = {t: _function(t) for t in (*SPEC_FUNCTIONS, f"{BATCH_RESULT}:{RESOLVE}")}
            for edit in spec_edits:
                self._bind_spec_edit(edit)
        self._drafts: Dict[int, List[int]] = {}
        self._results = _ResultProcessor()

    def _bind_spec_edit(self, edit: SourceEdit) -> None:
        """An edit of a function on the speculative path: called in place of the original by this
        subject (and, for one SGLang calls, named in its callers' modules while this subject runs)."""
        if edit.target not in self.spec_functions:
            raise EditError(f"{edit.name}: {edit.target} is not on {NAME}'s path ({', '.join(self.spec_functions)})")
        original = self.spec_functions[edit.target]
        copy = edited_function(edit)
        self.spec_functions[edit.target] = copy
        if edit.target.endswith(RESOLVE):
            return
        name = edit.target.split(":")[1]
        for module_name in CALLERS:
            module = importlib.import_module(module_name)
            if getattr(module, name, None) is original:
                self._installed.append((module, name, copy))

    @contextlib.contextmanager
    def _sglang(self) -> Iterator[None]:
        """This subject's runtime context and its functions in place, for the length of one call."""
        from sglang.srt.runtime_context import use_context

        saved = [(module, name, getattr(module, name)) for module, name, _ in self._installed]
        try:
            for module, name, value in self._installed:
                setattr(module, name, value)
            with use_context(self._runtime):
                yield
        finally:
            for module, name, value in reversed(saved):
                setattr(module, name, value)

    # -- what is built differently ------------------------------------------------------------------
    def build_req_to_token_pool(self, config: SubjectConfig) -> Any:
        # ModelRunner's rows under speculation: context length + get_req_to_token_extra_context_len()
        extra = importlib.import_module(ALLOCATION_SIZING).get_req_to_token_extra_context_len()
        return self.s.ReqToTokenPool(
            size=config.max_running_req,
            max_context_len=config.max_seq_len + extra,
            device="cpu",
            enable_memory_saver=False,
        )

    def build_capabilities(self, config: SubjectConfig) -> Capabilities:
        reserve = importlib.import_module(ALLOCATION_SIZING).get_alloc_reserve_per_decode()
        # committed = len(tokens) - 1, a row reaches ceil_page(committed + reserve)
        return replace(super().build_capabilities(config), spec_tokens=NUM_DRAFT_TOKENS - 1, max_ahead=reserve - 1)

    def batch_of(self, reqs: Sequence[Any]) -> Any:
        """A ScheduleBatch of `reqs` as the scheduler of a speculative deployment builds it
        (ScheduleBatch.init_new with its spec algorithm), this subject's batch edits bound on it."""
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        batch = self.s.ScheduleBatch.init_new(
            list(reqs),
            self.req_to_token_pool,
            self.allocator,
            self.tree,
            self._model_config,
            False,
            SpeculativeAlgorithm.from_string(ALGORITHM),
        )
        if self._batch_edits:
            bind(batch, self._batch_edits)
        return batch

    # -- the decode step ------------------------------------------------------------------------------
    def _allocate_decode(self, uid: int, req: Any, start: int, end: int) -> bool:
        torch = self.s.torch
        self.begin("decode", uid, "allocate")
        if end - start != NUM_DRAFT_TOKENS:
            raise DriverMismatch(f"uid {uid}: decode [{start}, {end}), the verify tree holds {NUM_DRAFT_TOKENS}")
        batch = self.batch_of([req])
        batch.seq_lens = torch.tensor([req.kv.kv_committed_len], dtype=torch.int64)
        batch.seq_lens_cpu = batch.seq_lens.clone()
        batch.req_pool_indices = torch.tensor([req.kv.req_pool_idx], dtype=torch.int64)
        batch.req_pool_indices_cpu = batch.req_pool_indices.clone()
        # the penalizer state eagle_prepare_for_decode reads (no penalties are configured)
        batch.sampling_info = types.SimpleNamespace(penalizer_orchestrator=types.SimpleNamespace(is_required=False))
        # update_running_batch: check_decode_mem evicts until the step fits and says whether it
        # does; nothing may change when it does not, so the same question comes first without evicting
        need = batch.new_tokens_required_next_decode()
        if need > self._available_and_evictable() or not batch.check_decode_mem():
            self.scheduler.retry(uid, "allocate")
            return False
        self.spec_functions[f"{EAGLE_UTILS}:eagle_prepare_for_decode"](batch)
        return True

    def drafted(self, uid: int, start: int, tokens: Sequence[int]) -> None:
        with self._sglang():
            req = self.requests[uid].req
            if start != len(req.origin_input_ids) + len(req.output_ids):
                at = len(req.origin_input_ids) + len(req.output_ids)
                raise DriverMismatch(f"uid {uid}: drafts from position {start}, its next token is at {at}")
            self._drafts[uid] = [int(t) for t in tokens]

    def computed(self, uid: int, start: int, end: int, token: int | None) -> None:
        with self._sglang():
            r = self.requests[uid]
            if r.phase != "running":
                super().computed(uid, start, end, token)
                return
            self.scheduler.step = None
            drafts = self._drafts.pop(uid, None)
            if drafts is None or token is None or not 0 < end - start <= NUM_DRAFT_TOKENS:
                raise DriverMismatch(f"uid {uid}: a verify result for [{start}, {end}) without its drafts")
            run = drafts[: end - start - 1] + [int(token)]
            req = r.req
            batch = self.batch_of([req])
            accepted = self._results.resolve(self.spec_functions[f"{BATCH_RESULT}:{RESOLVE}"], batch, run)
            # process_batch_result_decode: the verified run joins output_ids, then update_finish_state
            req.output_ids.extend(accepted[0])
            req.update_finish_state(len(accepted[0]))

    # -- every other call in this subject's context -----------------------------------------------------
    def submit(self, uid: int, prompt: Sequence[int], max_tokens: int) -> None:
        with self._sglang():
            super().submit(uid, prompt, max_tokens)

    def admit(self, uid: int, budget: int) -> int | None:
        with self._sglang():
            return super().admit(uid, budget)

    def allocate(self, uid: int, start: int, end: int) -> bool:
        with self._sglang():
            return super().allocate(uid, start, end)

    def finish(self, uid: int) -> None:
        with self._sglang():
            self._drafts.pop(uid, None)
            super().finish(uid)

    def abort(self, uid: int) -> None:
        with self._sglang():
            self._drafts.pop(uid, None)
            super().abort(uid)

    def preempt(self, uid: int) -> None:
        with self._sglang():
            self._drafts.pop(uid, None)
            super().preempt(uid)

    def evict(self, tokens: int) -> int:
        with self._sglang():
            return super().evict(tokens)

    def view(self) -> View:
        with self._sglang():
            return super().view()


def _function(target: str) -> Callable:
    module_name, _, path = target.partition(":")
    found: Any = importlib.import_module(module_name)
    for part in path.split("."):
        found = getattr(found, part)
    return found  # type: ignore[no-any-return]


class _ResultProcessor:
    """What `_resolve_spec_v2_tokens` reads of the scheduler's result processor: the metrics
    reporter and the model worker's verify hook (no-ops without metrics or adaptive speculation),
    and its own `advance_grammar_fsm`, which returns at once for requests without a grammar."""

    def __init__(self) -> None:
        module = importlib.import_module(BATCH_RESULT)
        self.processor = types.SimpleNamespace(
            metrics_reporter=types.SimpleNamespace(snapshot_spec_decode_metrics=lambda batch, result: None),
            model_worker=types.SimpleNamespace(on_verify_complete_cpu=lambda *args, **kwargs: None),
        )
        advance = module.SchedulerBatchResultProcessor.advance_grammar_fsm
        self.processor.advance_grammar_fsm = lambda result, batch: advance(self.processor, result, batch)

    def resolve(self, resolve: Callable, batch: Any, run: List[int]) -> List[List[int]]:
        """The worker's verify result for one request whose accepted run (drafts kept, then the
        bonus) is `run`, through `resolve_runs`."""
        return resolve_runs(self.processor, resolve, batch, [run])


def resolve_runs(processor: Any, resolve: Callable, batch: Any, runs: List[List[int]]) -> List[List[int]]:
    """The worker's verify result for a batch whose accepted runs are `runs` (drafts kept, then the
    bonus), padded to the verify width as the scheduler gets them, through `_resolve_spec_v2_tokens`."""
    import torch

    width = NUM_DRAFT_TOKENS
    flat = [t for run in runs for t in run + [0] * (width - len(run))]
    result = types.SimpleNamespace(
        next_token_ids=torch.tensor(flat, dtype=torch.int64),
        accept_lens=torch.tensor([len(run) for run in runs], dtype=torch.int32),
        speculative_output_stride=width,
        speculative_num_draft_tokens=width,
        num_non_draft_tokens_per_req=1,  # the bonus
        block_accept_lens=None,
        cap_lens=None,
        grammar_advanced=False,
        copy_done=None,
    )
    accepted: List[List[int]] = resolve(processor, result, batch)
    return accepted
