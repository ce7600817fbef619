"""`sglang:hicache`'s zoo: single planted bugs on SGLang 0.5.23's hierarchical cache (the match's host
hit, load-back, the transfer acks, the direct I/O backend's index pairing), each an edit of its
installed source (texts as in the dedented source). `kvledger zoo --subject sglang:hicache` runs
each and expects the judge (or SGLang's own error) to name it."""

from __future__ import annotations

from typing import Tuple

from kvledger.subjects.edits import SourceEdit
from kvledger.subjects.sglang_import import UNIFIED

HOST_MHA = "sglang.srt.mem_cache.pool_host.mha"
HOST_POOL_COMMON = "sglang.srt.mem_cache.pool_host.common"
CACHE_CONTROLLER = "sglang.srt.managers.cache_controller"
FULL = "sglang.srt.mem_cache.unified_cache.components.full:FullComponent"
TREE = f"{UNIFIED}:UnifiedRadixCache"
ZOO: Tuple[SourceEdit, ...] = (
    SourceEdit(
        "sglang-hicache-load-back-child-first",
        f"{FULL}.build_hicache_transfers",
        "backed_up.reverse()\n        nodes.reverse()",
        "nodes.reverse()",
        "the load-back spec gathers the host copies of a path of host-only nodes leaf first and "
        "forgets to reverse them, while the nodes are listed root first: the KV of the deepest node "
        "lands at the positions of the shallowest",
    ),
    SourceEdit(
        "sglang-hicache-load-back-offset-stuck",
        f"{FULL}.commit_hicache_transfer",
        "cd.value = device_indices[offset : offset + n_len].clone()\n            offset += n_len",
        "cd.value = device_indices[offset : offset + n_len].clone()",
        "committing a load-back never advances its offset into the loaded device indices: every node "
        "of the path points at the first node's locations, and the rest of the load is lost",
    ),
    SourceEdit(
        "sglang-hicache-host-hit-counts-device-nodes",
        f"{FULL}.finalize_match_result_in_tree_core",
        "while node is not result.last_device_node and node is not root_node:",
        "while node is not root_node:",
        "the match's host hit walks to the root instead of stopping at the last device node, so a "
        "backed-up node still on device counts as a host hit too: the load-back commits fewer tokens "
        "than the match promised (SGLang's own check in add_one_req raises)",
    ),
    SourceEdit(
        "sglang-hicache-load-ack-keeps-lock",
        f"{TREE}.loading_check",
        "self.dec_lock_ref(node, lock_params)\n            self.dec_host_lock_ref",
        "self.dec_host_lock_ref",
        "reaping a load-back's ack releases the host lock but not the device lock the load took: the "
        "loaded prefix stays locked after every request using it is gone",
    ),
    SourceEdit(
        "sglang-hicache-write-ack-keeps-lock",
        f"{TREE}._finish_write_through_ack",
        "if lock_params is not None:\n        self.dec_lock_ref(lock_node_id, lock_params)",
        "pass",
        "reaping a write-through backup's ack forgets the lock the backup took on the node: every "
        "backed-up prefix stays locked on device, never evictable",
    ),
    SourceEdit(
        "sglang-hicache-direct-indices-unpaired",
        f"{CACHE_CONTROLLER}:HiCacheController.move_indices",
        "return host_indices, device_indices.index_select(0, idx)",
        "return host_indices, device_indices",
        "the direct backend sorts the host indices of a transfer (layer-first layout) but leaves the "
        "device indices in their order: a transfer whose host slots are not in device order copies "
        "each token's KV to another token's slot",
    ),
)
