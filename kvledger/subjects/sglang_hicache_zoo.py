"""`sglang:hicache`'s zoo: single planted bugs on SGLang 0.5.23's hierarchical cache (the write-through
backup, eviction to host, the match's host hit, load-back), each an edit of its installed source
(texts as in the dedented source). `kvledger zoo --subject sglang:hicache` runs each and expects the
judge (or SGLang's own error) to name it."""

from __future__ import annotations

from typing import Tuple

from kvledger.subjects.edits import SourceEdit

HOST_MHA = "sglang.srt.mem_cache.pool_host.mha"
HOST_POOL_COMMON = "sglang.srt.mem_cache.pool_host.common"
ZOO: Tuple[SourceEdit, ...] = ()
