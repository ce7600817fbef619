"""`vllm:hybrid`: vLLM 0.33.0's real `Scheduler` over two KV cache groups, full attention and a
sliding window of W = 2 * block_size tokens, one block pool for both: vLLM's
`HybridKVCacheCoordinator` (`vllm/v1/core/kv_cache_coordinator.py:617`).

Everything runs as `vllm:sched` runs (`vllm_scheduler.py`): the builder only adds the second
group. What the hybrid path does that the plain one does not, all inside vLLM:
- before each allocation, `allocate_slots` has every group drop what its attention no longer
  reads (`KVCacheCoordinator.remove_skipped_blocks`, kv_cache_manager.py:564): the window
  group frees the blocks wholly before `computed - W + 1` and puts the null block (block 0) in
  their place in its table (`SingleTypeKVCacheManager._remove_blocks_in_range`,
  single_type_kv_cache_manager.py:655);
- a prefix hit is searched per group and reconciled (`HybridKVCacheCoordinator.
  find_longest_cache_hit`, :806): the full-attention group's hit first, then the window group's
  finder needs `cdiv(W - 1, block_size)` contiguous cached blocks at the hit's end and returns
  null blocks before them (`SlidingWindowManager.find_longest_cache_hit`, :969); the hit is the
  shorter of the two;
- each group files its full blocks under its own key (the block hash plus the group id).

The View (`vllm_scheduler_view.scheduler_view`): `requests` is the full-attention group's table,
`groups` = [the window group's table with None at null blocks], cached blocks carry their group.

The finder is a classmethod the coordinator calls on the class it keeps in `attention_groups`,
so a zoo edit of it is bound by putting a subclass with the edited method there, for this one
coordinator (`bind_finder_edits`); every other edit binds on the objects as for `vllm:sched`.
"""

from __future__ import annotations

import importlib
from typing import Any, List, Sequence, Tuple

from kvledger.properties.subject import SubjectConfig
from kvledger.subjects import vllm_scheduler
from kvledger.subjects.edits import EditError, SourceEdit, edited_function
from kvledger.subjects.vllm_groups_zoo import HYBRID_ZOO
from kvledger.subjects.vllm_scheduler import Variant, VllmSchedulerSubject
from kvledger.subjects.vllm_scheduler_build import FULL, Group

NAME = "vllm:hybrid"
WINDOW_BLOCKS = 2  # the sliding window, in blocks: W = 2 * block_size
ZOO: Tuple[SourceEdit, ...] = HYBRID_ZOO
MIN_PAGE_SIZE = 2  # with one-token blocks a window of 2 needs one contiguous block, rounded or not


def probe(path: str | None = None) -> Tuple[bool, str, str]:
    return vllm_scheduler.probe(path)


def variant(page_size: int) -> Variant:
    return Variant(NAME, groups=(FULL, Group(window=WINDOW_BLOCKS * page_size)))


def build(config: SubjectConfig, path: str | None = None, edits: Sequence[SourceEdit] = ()) -> "VllmHybridSubject":
    if path:
        raise ValueError(f"{NAME} takes no path")
    vllm_scheduler.PACKAGE.load()
    return VllmHybridSubject(config, edits)


def _is_classmethod(edit: SourceEdit) -> bool:
    module_name, path = edit.split()
    owner: Any = importlib.import_module(module_name)
    for part in path[:-1]:
        owner = getattr(owner, part, None)
    return isinstance(owner, type) and isinstance(owner.__dict__.get(path[-1]), classmethod)


class VllmHybridSubject(VllmSchedulerSubject):
    """`VllmSchedulerSubject` built with a full-attention and a sliding-window group."""

    name = NAME

    def __init__(self, config: SubjectConfig, edits: Sequence[SourceEdit] = (), second: Group | None = None) -> None:
        on_class = [e for e in edits if _is_classmethod(e)]
        groups = variant(config.page_size).groups if second is None else (FULL, second)
        super().__init__(config, Variant(self.name, groups=groups), [e for e in edits if e not in on_class])
        bind_finder_edits(self.scheduler.kv_cache_manager.coordinator, on_class)


def bind_finder_edits(coordinator: Any, edits: Sequence[SourceEdit]) -> None:
    """Bind classmethod edits of a manager class (the prefix-hit finders) for this coordinator
    alone: each attention group whose manager class has the edited method gets a subclass that
    carries the edited copy (edits of one class go into one subclass, in order)."""
    by_class: dict[type, List[SourceEdit]] = {}
    for edit in edits:
        module_name, path = edit.split()
        owner: Any = importlib.import_module(module_name)
        for part in path[:-1]:
            owner = getattr(owner, part)
        by_class.setdefault(owner, []).append(edit)
    groups = list(coordinator.attention_groups)
    for owner, class_edits in by_class.items():
        hit = [i for i, g in enumerate(groups) if issubclass(g.manager_cls, owner)]
        if not hit:
            raise EditError(f"{class_edits[0].name}: no KV cache group of this coordinator uses {owner.__name__}")
        methods: dict[str, Any] = {}
        for target in dict.fromkeys(e.target for e in class_edits):
            methods[target.rpartition(".")[2]] = edited_function([e for e in class_edits if e.target == target])
        for i in hit:
            cls = groups[i].manager_cls
            edited = type(f"{cls.__name__}Edited", (cls,), dict(methods))
            groups[i] = groups[i]._replace(manager_cls=edited)
    coordinator.attention_groups = groups
