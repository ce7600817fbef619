"""`sglang:overlap`: SGLang 0.5.23's overlap event loop (`Scheduler.event_loop_overlap`,
scheduler.py:2061, on by default: `disable_overlap_schedule=False`) as it touches the cache.

The loop gets the next batch, launches it, and only then processes the previous batch's result
(`pop_and_process`, :2073). So step N+1 is allocated while step N's accepted tokens are not yet
committed. Where that lag shows is speculative decoding (spec v2, whose allocation reads
kv_committed_len): `eagle_prepare_for_decode` (eagle_utils.py:857) allocates up to
ceil_page(kv_committed_len + reserve) with the reserve twice one step's length, "a double-buffer
that absorbs the kv_committed_len lag in overlap mode" (allocation_sizing.py:64-67; the same words
at schedule_batch.py:2314), and `check_decode_mem` estimates the same (`_new_tokens_required_next_decode_spec_v2`,
schedule_batch.py:3421). Plain decode commits at allocation (`alloc_for_decode_default`,
allocation.py:685-686: kv_committed_len moves with kv_allocated_len), so nothing lags there. The
subject is therefore the deployment of `sglang:spec` (NGRAM, 4 draft tokens, page 4, torch_native
attention) with its scheduler loop overlapped, and `sglang:paged`'s decode memory check and
`retract_decode` with the same knobs (`PAGED_KNOBS`), so that small pools fill in decode.

What the adapter keeps of the loop (the batch launched and not yet processed lives here):
- a decode step's first allocation runs `Scheduler.update_running_batch` for the running batch
  (scheduler.py:4459): `check_decode_mem`, `retract_decode` when it does not fit, then
  `prepare_for_decode` -> `eagle_prepare_for_decode` for the whole batch, reading
  kv_committed_len as it stands: without the previous step's accepted runs, which wait in the
  result queue (`_queue`). A step's results, as the driver hands them (`computed`), are held
  (`_launched`); at the next step's first allocation (its batch scheduled) they become the queue;
- the queue is processed at the first result of the next step (by then that step is scheduled
  and launched), or before any call that is not part of a step (finish, abort, evict), as
  `process_batch_result_decode` (batch_result_processor.py:952) does: inside
  `free_group_begin()`/`free_group_end()` (:998/:1100), `_resolve_spec_v2_tokens` (:770) commits
  each accepted run (it skips a request retracted meanwhile, :819), then output_ids and
  update_finish_state;
- a prompt's last chunk waits the same way: the next step's `get_next_batch_to_run` merges the
  request into the running batch (its first decode is allocated from kv_committed_len = the
  prompt) before `process_batch_result_prefill` (:258, grouped at :264/:501) appends its first
  token and checkpoints it into the tree (`checkpoint_kv_cache`); a middle chunk's result changes
  nothing in the cache, its checkpoint comes at the next step's top (`stash_chunked_request`);
- a request the driver ends (finish, or abort of a running one) leaves through that processing:
  its result and everything received before it are processed, and `release_kv_cache` (common.py:400)
  runs inside the free group, freeing [cache_protected_len, owned) and the tail held ahead,
  [ceil_page(owned), kv_allocated_len) (`_release_overallocated_kv_indices`, :447). Frees inside a
  group are only recorded (`free_group`, `free_page_ids_group`: allocator/paged.py:328-390) and
  reach the free list at its end;
- a chunked request aborted mid-prefill: `abort_request` marks `_pending_chunked_abort_req`, and
  `process_pending_chunked_abort` (scheduler.py:3778) releases it at the top of the next step,
  before the stash of its chunk; the driver's abort comes between steps, so it runs there.

Where the protocol makes the adapter differ from SGLang's loop (each a state SGLang reaches too):
- the driver decides a request's end with the results of its step, and holds the subject to
  releasing it in that call: a step with a request ending is processed before the next step is
  scheduled (SGLang's order when the next iteration has no batch), so a finished request is
  never part of a step scheduled after its last one;
- a request `retract_decode` releases while its last result is queued loses that result in
  SGLang (the resolve skips it, and it runs again from its origin and output tokens); the driver
  has already handed those tokens out, so the adapter appends them to its output_ids, as its
  resumed prompt;
- the last request, which `retract_decode` aborts when even it alone does not fit, SGLang ends;
  the driver requeues it (as in `sglang:paged`), so the adapter drops its pending FINISH_ABORT and
  it resumes as a retracted request does;
- a free group spans one release (or one queue's processing) here, where SGLang's spans a
  batch's result processing: the free list's order may differ, its pages do not;
- a step that only refused an admission leaves the results where they were (SGLang's loop,
  finding no batch, processes them in that iteration): the driver holds a refused admission to
  changing nothing, and a refusal changes nothing, so the next step sees what it would have seen
  had the refused one not run.
The one stub is `sglang:spec`'s (`assign_req_to_token_pool_func`, a Triton kernel).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Dict, FrozenSet, Iterator, List, Sequence, Set, Tuple

from kvledger.properties.subject import DriverMismatch, SubjectConfig
from kvledger.subjects.edits import SourceEdit
from kvledger.subjects.sglang import SglangSubject, load
from kvledger.subjects.sglang_import import COMMON, PACKAGE, VERSION, SglangNames
from kvledger.subjects.sglang_overlap_zoo import ZOO
from kvledger.subjects.sglang_paged import PagedSglangSubject
from kvledger.subjects.sglang_spec import NUM_DRAFT_TOKENS, PAGE_SIZE, SpecSglangSubject, _function, resolve_runs
from kvledger.subjects.sglang_spec_zoo import ALLOCATION_SIZING, BATCH_RESULT, EAGLE_UTILS, RESOLVE

__all__ = ["MIN_PAGE_SIZE", "NAME", "OVERLAP_EVENTS", "VERSION", "ZOO", "OverlapSglangSubject", "build", "probe"]

NAME = "sglang:overlap"
MIN_PAGE_SIZE = PAGE_SIZE  # sglang:spec's deployment: page size 4 only
# SGLang's functions on the overlap path this subject calls beyond sglang:spec's (an edit of one is
# installed in the modules that import it by name while the subject runs)
OVERLAP_FUNCTIONS: Tuple[str, ...] = (f"{ALLOCATION_SIZING}:get_alloc_reserve_per_decode",)

# the rare states of the overlap loop (the subject reports them; `rare_events` declares them)
LAGGED = "overlap: a step allocated while the previous step's results were queued"
GROUP_RELEASED = "overlap: a free group ended with pages in it"
ENDED_AHEAD = "overlap: a request ended holding a page allocated ahead"
RETRACTED_QUEUED = "overlap: a request retracted while its last result was queued"
CHUNK_ABORT = "overlap: a chunked abort released before its chunk was stashed"
PREFILL_LAGGED = "overlap: a prefill's result processed after the next step was scheduled"
OVERLAP_EVENTS: FrozenSet[str] = frozenset(
    {LAGGED, GROUP_RELEASED, ENDED_AHEAD, RETRACTED_QUEUED, CHUNK_ABORT, PREFILL_LAGGED}
)


def probe(path: str | None = None) -> Tuple[bool, str, str]:
    return PACKAGE.probe()


def build(config: SubjectConfig, path: str | None = None, edits: Sequence[SourceEdit] = ()) -> "OverlapSglangSubject":
    PACKAGE.no_path(path)
    return OverlapSglangSubject(config, load(), edits)


class OverlapSglangSubject(PagedSglangSubject, SpecSglangSubject):
    """sglang:spec's deployment under the overlap loop, with sglang:paged's memory check and retraction."""

    name = NAME
    rare_events = OVERLAP_EVENTS

    def __init__(self, config: SubjectConfig, s: SglangNames, edits: Sequence[SourceEdit] = ()) -> None:
        self._launched: Dict[int, List[int]] = {}  # this step's decode results (its batch is in flight)
        self._queue: Dict[int, List[int]] = {}  # the previous step's, not yet processed (result_queue)
        self._prefilled: Set[int] = set()  # uids whose held result is their prompt's first token
        self._fresh = False  # a step has begun and has not allocated yet
        self.reached: List[str] = []  # rare states reached since the driver last looked
        mine = [e for e in edits if e.target in OVERLAP_FUNCTIONS]
        super().__init__(config, s, [e for e in edits if e not in mine])
        with self._sglang():
            for target in OVERLAP_FUNCTIONS:
                self.spec_functions[target] = _function(target)
            for edit in mine:
                self._bind_spec_edit(edit)

    def _running_batch(self) -> Any:
        batch = super()._running_batch()
        # the sampling state retract_decode narrows and eagle_prepare_for_decode reads (no penalties)
        batch.sampling_info = types.SimpleNamespace(
            filter_batch=lambda keep, keep_device: None,
            penalizer_orchestrator=types.SimpleNamespace(is_required=False),
        )
        return batch

    # -- the loop's order ---------------------------------------------------------------------------------
    def begin(self, kind: str, uid: int, call: str) -> bool:
        """At a step's first allocation (its batch is scheduled) the last step's results join the
        queue. A queue still unprocessed then (its step allocated and computed nothing) is processed
        first, as the loop pops it when it has no batch. A step that only refused an admission
        changed nothing: it leaves the results where they were, as if it had not run."""
        started = super().begin(kind, uid, call)
        if started:
            self._fresh = True
        if call == "allocate" and self._fresh:
            self._fresh = False
            if self._queue:
                self._process(self._queue)
            self._queue, self._launched = self._launched, {}
        return started

    def _known(self, req: Any, uid: int) -> int:
        """The tokens the driver has for `uid`: SGLang's, plus the accepted run still queued."""
        return len(req.origin_input_ids) + len(req.output_ids) + len(self._queue.get(uid, ()))

    def _allocate_decode(self, uid: int, req: Any, start: int, end: int) -> bool:
        self.begin("decode", uid, "allocate")
        if end - start != NUM_DRAFT_TOKENS or start != self._known(req, uid) - 1:
            raise DriverMismatch(f"uid {uid}: decode [{start}, {end}) with {self._known(req, uid)} tokens known")
        if uid in self._decoded:
            return True  # the step's prepare_for_decode served the whole batch
        if self._retracted:
            self.scheduler.retry(uid, "allocate")
            return False
        batch = self._running_batch()
        if not self._checked:
            self._checked = True
            if not batch.check_decode_mem():
                self._retract(batch)
                self.scheduler.retry(uid, "allocate")
                return False
        if any(u in self._queue for u in self._decoding()):
            self.reached.append(LAGGED)
        self.spec_functions[f"{EAGLE_UTILS}:eagle_prepare_for_decode"](batch)
        self._decoded = set(self._decoding())
        return True

    def _decoding(self) -> List[int]:
        return [u for u, r in self.requests.items() if r.phase == "running"]

    def _retract(self, batch: Any) -> None:
        """update_running_batch's retract_decode (scheduler.py:4459), as sglang:paged runs it (the last
        request it aborts resumes without the abort: left, every later result of it would be skipped
        as a finished request's)."""
        super()._retract(batch)
        for victim in self._retracted:
            if victim in self._queue:
                self.reached.append(RETRACTED_QUEUED)

    def drafted(self, uid: int, start: int, tokens: Sequence[int]) -> None:
        with self._sglang():
            req = self.requests[uid].req
            if start != self._known(req, uid):
                raise DriverMismatch(f"uid {uid}: drafts from position {start}, {self._known(req, uid)} tokens known")
            self._drafts[uid] = [int(t) for t in tokens]

    def computed(self, uid: int, start: int, end: int, token: int | None) -> None:
        with self._sglang():
            if self._queue:  # the step is launched: pop_and_process of the one before
                if self._prefilled & set(self._queue):
                    self.reached.append(PREFILL_LAGGED)
                self._process(self._queue)
                self._queue = {}
            r = self.requests[uid]
            if r.phase == "admitted" and token is not None:
                # the prompt's last chunk: its result waits for the next step, as a decode's does;
                # the next step's get_next_batch_to_run merges the request into the running batch
                # (scheduler.py:3894) before that result is processed
                req = r.req
                if end != req.extend_end or end != len(req.full_untruncated_fill_ids):
                    raise DriverMismatch(f"uid {uid}: a token after [{start}, {end}), extend ends at {req.extend_end}")
                self.scheduler.step = None
                r.phase = "running"
                self._launched[uid] = [int(token)]
                self._prefilled.add(uid)
                return
            if r.phase != "running":
                SglangSubject.computed(self, uid, start, end, token)  # a middle chunk: stashed at the next top
                return
            self.scheduler.step = None
            drafts = self._drafts.pop(uid, None)
            if drafts is None or token is None or not 0 < end - start <= NUM_DRAFT_TOKENS:
                raise DriverMismatch(f"uid {uid}: a verify result for [{start}, {end}) without its drafts")
            self._launched[uid] = drafts[: end - start - 1] + [int(token)]

    def _drain(self) -> None:
        """Every result received so far processed, oldest first (a call between steps)."""
        for results in (self._queue, self._launched):
            if results:
                self._process(results)
        self._queue, self._launched = {}, {}

    def _process(self, results: Dict[int, List[int]]) -> None:
        """process_batch_result_decode (or _prefill) of one step's results, in batch order."""
        uids = [u for u in results if u in self.requests]
        if not uids:
            return
        if self._prefilled & set(uids):
            self._process_prefill(uids, results)
            return
        reqs = [self.requests[u].req for u in uids]
        batch = self.batch_of(reqs)
        resolve = self.spec_functions[f"{BATCH_RESULT}:{RESOLVE}"]
        with self._group():
            accepted = resolve_runs(self._results.processor, resolve, batch, [results[u] for u in uids])
            for uid, req, run in zip(uids, reqs, accepted):
                if req.is_retracted or req.finished():
                    # skipped under overlap (batch_result_processor.py:1022); the driver's tokens
                    # become the retracted request's resumed prompt (see the module doc)
                    if req.is_retracted:
                        req.output_ids.extend(results[uid])
                    continue
                req.output_ids.extend(run)
                req.update_finish_state(len(run))

    def _process_prefill(self, uids: List[int], results: Dict[int, List[int]]) -> None:
        """process_batch_result_prefill (batch_result_processor.py:258) of the prompts' last chunks:
        the first token, update_finish_state, and checkpoint_kv_cache of a request that goes on (one
        that finished is released by the driver's finish, in this processing)."""
        with self._group():
            for uid in uids:
                self._prefilled.discard(uid)
                r = self.requests[uid]
                req = r.req
                if req.is_retracted:  # skipped (:346); its resumed prompt is the driver's tokens
                    req.output_ids.extend(results[uid])
                    continue
                r.phase = "running"
                req.output_ids.extend(results[uid])
                req.update_finish_state()
                if not req.finished():
                    self.functions[f"{COMMON}:checkpoint_kv_cache"](req, self.tree)

    @contextlib.contextmanager
    def _group(self) -> Iterator[None]:
        """free_group_begin() ... free_group_end() around result processing (one group at a time)."""
        allocator = self.allocator
        if allocator.free_group is not None:
            yield
            return
        allocator.free_group_begin()
        try:
            yield
        finally:
            if allocator.free_group or allocator.free_page_ids_group:
                self.reached.append(GROUP_RELEASED)
            allocator.free_group_end()

    # -- calls between steps: the queue is processed first ----------------------------------------------
    def finish(self, uid: int) -> None:
        with self._sglang():
            self._drain()
            self._ended(uid)
            with self._group():
                super().finish(uid)

    def abort(self, uid: int) -> None:
        with self._sglang():
            self._drain()
            r = self.requests.get(uid)
            if r is not None and r.phase == "admitted" and self.chunk_to_stash == uid:
                self.reached.append(CHUNK_ABORT)
            if r is None or r.phase != "running":
                super().abort(uid)  # process_pending_chunked_abort, or a waiting request
                return
            self._ended(uid)
            with self._group():
                super().abort(uid)

    def _ended(self, uid: int) -> None:
        req = self.requests[uid].req
        if req.kv.holds_kv and req.kv.kv_allocated_len > -(-req.owned_kv_len() // PAGE_SIZE) * PAGE_SIZE:
            self.reached.append(ENDED_AHEAD)

    def evict(self, tokens: int) -> int:
        with self._sglang():
            self._drain()
            return super().evict(tokens)
