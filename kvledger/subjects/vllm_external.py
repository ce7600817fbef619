"""`vllm:external`: vLLM 0.33.0's real `Scheduler` with a KV connector's scheduler side, the
`ExampleConnector` (`vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py`), whose
store is the driver's `ExternalStore`: KV computed elsewhere, loaded into the pool.

The scheduler's own external path runs (scheduler.py, the waiting loop, :1104-1530): a local
prefix hit (`get_computed_blocks`), then `connector.get_num_new_matched_tokens(request,
block_aligned_local)` -> (external tokens, load asynchronously), then `allocate_slots(...,
num_external_computed_tokens=ext, delay_cache_blocks=async)`, which touches the hit blocks and
allocates new ones for the external range, then `connector.update_state_after_alloc`. A
synchronous load is computed in the same step (its tokens count as computed at once); an
asynchronous one leaves the request in WAITING_FOR_REMOTE_KVS holding its blocks, unhashed,
until the worker reports the load done (`KVConnectorOutput.finished_recving`, handed to
`update_from_output`); the next `schedule()` files the loaded blocks
(`_update_waiting_for_remote_kv`, :3467) and schedules the rest of the prompt.

The connector is the real object the scheduler built; the adapter replaces two of its methods:
- `get_num_new_matched_tokens` asks the store (`subject.store`, set by the driver) instead of
  ExampleConnector's files, and keeps ExampleConnector's contract: whole blocks, never the last
  token (`align_to_block_size(len - 1)` in the original);
- `update_state_after_alloc` records what vLLM settled on (the external tokens after its own
  trimming) and hands synchronous loads to ExampleConnector's bookkeeping; an asynchronous load
  is kept out of it (ExampleConnector loads in the same step only: its `build_connector_meta`
  asserts every recorded load is scheduled in that step).
The worker side (the copy into the blocks) is the driver's: it reports a load done with the
outputs (`output(..., loaded)`). A request aborted while its KV loads is freed by vLLM only when
the worker reports that load done (`finish_requests` delays the free, :3017); the adapter plays
that report at once (`_update_from_kv_xfer_finished`, the method update_from_output calls for
the connector's output, :3560), as a worker that cancels the transfer would.

The connector has no `SupportsHMA`, so vLLM runs one full-attention KV group here (it turns the
hybrid manager off for such a connector).
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from kvledger.properties.scheduling_subject import ExternalStore, Output, Plan, Scheduled
from kvledger.properties.subject import SubjectConfig
from kvledger.subjects import vllm_scheduler
from kvledger.subjects.edits import SourceEdit
from kvledger.subjects.vllm_groups_zoo import EXTERNAL_ZOO
from kvledger.subjects.vllm_scheduler import Variant, VllmSchedulerSubject

NAME = "vllm:external"
ZOO: Tuple[SourceEdit, ...] = EXTERNAL_ZOO
_VARIANT: List[Variant] = []  # built once per process (its connector's storage directory)


def probe(path: str | None = None) -> Tuple[bool, str, str]:
    return vllm_scheduler.probe(path)


def build(config: SubjectConfig, path: str | None = None, edits: Sequence[SourceEdit] = ()) -> "VllmExternalSubject":
    if path:
        raise ValueError(f"{NAME} takes no path")
    vllm_scheduler.PACKAGE.load()
    return VllmExternalSubject(config, edits)


def variant() -> Variant:
    if not _VARIANT:
        # ExampleConnector's files are never read or written here (its matching is the store's),
        # but its constructor wants a storage path
        path = tempfile.mkdtemp(prefix="kvledger-vllm-external-")
        transfer = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": path},
        }
        _VARIANT.append(Variant(NAME, kv_transfer=transfer))
    return _VARIANT[0]


class StoreConnector:
    """The two replaced methods of the scheduler's ExampleConnector, and what they saw."""

    def __init__(self, connector: Any, block_size: int) -> None:
        self.connector = connector
        self.block_size = block_size
        self.store: Optional[ExternalStore] = None
        self._update = connector.update_state_after_alloc
        self.asked: Dict[str, bool] = {}  # request id -> the store's answer was an async load
        self.settled: List[Tuple[str, int, bool]] = []  # (request id, external tokens, async), this step
        connector.get_num_new_matched_tokens = self.get_num_new_matched_tokens
        connector.update_state_after_alloc = self.update_state_after_alloc

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        if self.store is None:
            return 0, False
        found, load_async = self.store.match(list(request.all_token_ids), num_computed_tokens)
        bs = self.block_size
        limit = (request.num_tokens - 1) // bs * bs - num_computed_tokens
        found = max(0, min(int(found), limit))
        found -= found % bs
        if not found:
            return 0, False
        self.asked[request.request_id] = bool(load_async)
        return found, bool(load_async)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        load_async = self.asked.pop(request.request_id, False) and num_external_tokens > 0
        if num_external_tokens > 0:
            self.settled.append((request.request_id, int(num_external_tokens), load_async))
        if not load_async:
            self._update(request, blocks, num_external_tokens)


class VllmExternalSubject(VllmSchedulerSubject):
    """`VllmSchedulerSubject` with ExampleConnector's scheduler side asking the driver's store."""

    name = NAME

    def __init__(self, config: SubjectConfig, edits: Sequence[SourceEdit] = ()) -> None:
        super().__init__(config, variant(), edits)
        self.capabilities = replace(self.capabilities, external_kv=True)
        self.bridge = StoreConnector(self.scheduler.connector, self.block_size)
        self.loading: Set[int] = set()  # admitted in WAITING_FOR_REMOTE_KVS, load not yet reported done
        self.loaded: Set[int] = set()  # load reported done, not yet scheduled (its admission was the load's)

    @property
    def store(self) -> Optional[ExternalStore]:
        return self.bridge.store

    @store.setter
    def store(self, store: Optional[ExternalStore]) -> None:
        self.bridge.store = store

    def schedule(self, budget: Optional[int]) -> Plan:
        self.bridge.settled = []
        plan = super().schedule(budget)
        external = {int(rid): (n, load_async) for rid, n, load_async in self.bridge.settled}
        scheduled: List[Scheduled] = []
        for item in plan.scheduled:
            if item.uid in self.loaded:
                # admitted when its load began: now it computes the rest of its prompt
                self.loaded.discard(item.uid)
                item = replace(item, hit=None, external=0)
            elif item.hit is not None and item.uid in external:
                item = replace(item, external=external[item.uid][0])
            scheduled.append(item)
        loading: List[int] = []
        requests = self.scheduler.requests
        for uid, (n, load_async) in external.items():
            request = requests.get(str(uid))
            if not load_async or request is None or request.status != self.v.RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            # _update_after_schedule never sees it: num_computed_tokens = local + external (:1527)
            local = request.num_computed_tokens - n
            scheduled.append(Scheduled(uid=uid, start=local, end=local, hit=local + n, external=n))
            loading.append(uid)
            self.loading.add(uid)
        refused = plan.refused
        if refused in self.loaded:
            # its KV arrived but allocate_slots found no room for the rest of its prompt: a
            # request already admitted (at its load) that this step did not schedule
            refused = None
        return replace(plan, scheduled=tuple(scheduled), loading=tuple(loading), refused=refused)

    def output(self, outputs: Dict[int, Output], loaded: Sequence[int] = ()) -> None:
        done = [u for u in loaded if u in self.loading]
        self.loading.difference_update(done)
        self.loaded.update(done)
        super().output(outputs, loaded)
        if done:
            # the worker's KVConnectorOutput(finished_recving=...) of this step: update_from_output
            # hands it to _update_from_kv_xfer_finished last (scheduler.py:2581), as here
            self._recved(done)

    def abort(self, uid: int) -> None:
        super().abort(uid)
        self.loaded.discard(uid)
        if uid in self.loading:
            self.loading.discard(uid)
            self._recved([uid])

    def _recved(self, uids: Sequence[int]) -> None:
        from vllm.v1.outputs import KVConnectorOutput

        self.scheduler._update_from_kv_xfer_finished(KVConnectorOutput(finished_recving={str(u) for u in uids}))
