"""`vllm:local`: vLLM 0.33.0's real `Scheduler` over a full-attention group and a chunked local
attention group (Llama 4's iRoPE layers: position p attends to its own chunk of C = 2 *
block_size tokens only, [p // C * C, p]), one block pool for both, through vLLM's
`HybridKVCacheCoordinator` as `vllm:hybrid` runs it with a sliding window.

What the chunked-local group does, all inside vLLM (`ChunkedLocalAttentionManager`,
vllm/v1/core/single_type_kv_cache_manager.py:1276):
- before each allocation, `remove_skipped_blocks` frees every block wholly before the chunk of
  the next position to compute (`get_num_skipped_tokens`: `computed // C * C`) and puts the null
  block in its place;
- a prefix hit in that group is null blocks up to the chunk the hit ends in, then the cached
  blocks of that chunk (`find_longest_cache_hit`), reconciled with the full-attention group's hit
  by the coordinator;
- the startup check sizes the group as min(C + max_in_flight_tokens, max_model_len) tokens per
  request (`ChunkedLocalAttentionSpec.max_admission_blocks_per_request`), the whole request here,
  as the driver counts it.

The View's second group is `GroupView(chunk=C)`: the judge checks that a live request still holds
KV of its prefix from the start of its next position's chunk (`GroupView.first_read`), and what a
step reads before it runs.
"""

from __future__ import annotations

from typing import Sequence, Tuple

from kvledger.properties.subject import SubjectConfig
from kvledger.subjects import vllm_scheduler
from kvledger.subjects.edits import SourceEdit
from kvledger.subjects.vllm_groups_zoo import LOCAL_ZOO
from kvledger.subjects.vllm_hybrid import VllmHybridSubject
from kvledger.subjects.vllm_scheduler_build import Group

NAME = "vllm:local"
CHUNK_BLOCKS = 2  # the attention chunk, in blocks: C = 2 * block_size
ZOO: Tuple[SourceEdit, ...] = LOCAL_ZOO
MIN_PAGE_SIZE = 2  # as vllm:hybrid: a one-token block makes every chunk two blocks, nothing to round


def probe(path: str | None = None) -> Tuple[bool, str, str]:
    return vllm_scheduler.probe(path)


def build(config: SubjectConfig, path: str | None = None, edits: Sequence[SourceEdit] = ()) -> "VllmLocalSubject":
    if path:
        raise ValueError(f"{NAME} takes no path")
    vllm_scheduler.PACKAGE.load()
    return VllmLocalSubject(config, edits)


class VllmLocalSubject(VllmHybridSubject):
    """`VllmSchedulerSubject` built with a full-attention and a chunked local attention group."""

    name = NAME

    def __init__(self, config: SubjectConfig, edits: Sequence[SourceEdit] = ()) -> None:
        super().__init__(config, edits, Group(chunk=CHUNK_BLOCKS * config.page_size))
