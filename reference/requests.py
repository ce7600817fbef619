"""Requests as the cache manager sees them: lengths, the table row, and the cache handle.

`PendingReq` waits for admission; `Req` is admitted and owns a page-table row; `ChunkedReq` is a
request whose prompt is being prefilled in chunks (it holds pages but never decodes).
Lengths: `cached_len` positions already have KV in the pool, `device_len` positions will have KV
after this step, `max_device_len = len(prompt) + max_tokens`.

Speculative decoding (the step: `properties/speculating_scheduler.py`): a decode step may verify
drafts after a request's last token. `propose` reserves them (`device_len` then counts them: the
step's locations run past the committed KV), `verify` commits the accepted ones and the bonus
token and says where the step's locations ended, so the cache manager can drop the rejected tail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Sequence


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    ignore_eos: bool = False
    max_tokens: int = 1024
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()

    @property
    def is_greedy(self) -> bool:
        return (self.temperature <= 0.0 or self.top_k == 1) and self.top_p == 1.0


class Req:
    def __init__(
        self,
        input_ids: Any,
        table_idx: int,
        cached_len: int,
        output_len: int,
        uid: int,
        sampling_params: SamplingParams,
        cache_handle: Any,
    ) -> None:
        self.input_ids = input_ids
        self.table_idx = table_idx
        self.cached_len = cached_len
        self.output_len = output_len
        self.uid = uid
        self.sampling_params = sampling_params
        self.cache_handle = cache_handle
        self.device_len = len(input_ids)
        self.max_device_len = len(input_ids) + output_len
        self.drafts: List[int] = []  # tokens this step verifies after the last one (speculation)
        if not 0 <= cached_len < self.device_len <= self.max_device_len:
            raise ValueError(
                f"request {uid}: need 0 <= cached_len ({cached_len}) < device_len "
                f"({self.device_len}) <= max_device_len ({self.max_device_len})"
            )

    @property
    def remain_len(self) -> int:
        return self.max_device_len - self.device_len

    @property
    def extend_len(self) -> int:
        return self.device_len - self.cached_len

    @property
    def can_decode(self) -> bool:
        return self.remain_len > 0

    def complete_one(self) -> None:
        """The step's tokens now have KV; the next step computes one more position."""
        self.cached_len = self.device_len
        self.device_len += 1

    def append_host(self, next_token: int) -> None:
        self.input_ids = list(self.input_ids) + [int(next_token)]

    # -- speculative decoding -------------------------------------------------------------------
    @property
    def draft_room(self) -> int:
        """Drafts one step may verify: every accepted draft and the bonus token become tokens of
        the request, and its last token never gets KV, so the step writes positions below
        max_device_len - 1 at most (the worst case admission reserved)."""
        return max(self.remain_len - 1, 0)

    def propose(self, drafts: Sequence[int]) -> None:
        """This step computes the last token and `drafts` after it: positions [cached_len,
        device_len + len(drafts)) get locations (the lookahead) and KV."""
        if self.drafts:
            raise RuntimeError(f"request {self.uid}: drafts proposed twice in one step")
        if len(drafts) > self.draft_room:
            raise ValueError(f"request {self.uid}: {len(drafts)} drafts, room for {self.draft_room}")
        self.drafts = [int(t) for t in drafts]
        self.device_len += len(self.drafts)

    def verify(self, accepted: int, bonus: int) -> int:
        """After the forward: the first `accepted` drafts and the token the model sampled after
        them (`bonus`) are the request's next tokens, and KV is committed through the last accepted
        draft. Returns where the step's locations ended: positions [cached_len, that end) hold the
        rejected drafts' KV, which the cache manager drops (`CacheManager.release_rejected`)."""
        if not 0 <= accepted <= len(self.drafts):
            raise ValueError(f"request {self.uid}: {accepted} drafts accepted of {len(self.drafts)}")
        reserved_end = self.device_len
        committed = reserved_end - len(self.drafts) + accepted
        self.input_ids = list(self.input_ids) + self.drafts[:accepted] + [int(bonus)]
        self.cached_len, self.device_len = committed, committed + 1
        self.drafts = []
        return reserved_end

    def set_host_token(self, index: int, token: int) -> None:
        """Replace a token already appended (the engine appends a placeholder while the sampled
        value is still on the GPU, and fills it in one step later)."""
        if not 0 <= index < len(self.input_ids):
            raise IndexError(f"request {self.uid}: token index {index} outside [0, {len(self.input_ids)})")
        ids = list(self.input_ids)
        ids[index] = int(token)
        self.input_ids = ids

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(uid={self.uid}, table_idx={self.table_idx}, "
            f"cached_len={self.cached_len}, device_len={self.device_len}, "
            f"max_device_len={self.max_device_len})"
        )


class ChunkedReq(Req):
    """A prompt prefilled in chunks: not sampled, never decoded, until its last chunk."""

    @property
    def can_decode(self) -> bool:
        return False

    def append_host(self, next_token: int) -> None:
        raise RuntimeError(f"request {self.uid}: a chunked prefill produces no token")


@dataclass(eq=False)
class PendingReq:
    uid: int
    input_ids: List[int]
    sampling_params: SamplingParams
    chunked_req: Req | None = None

    def __post_init__(self) -> None:
        self.input_ids = [int(t) for t in self.input_ids]
        validate_pending(self.uid, len(self.input_ids), self.sampling_params)

    @property
    def input_len(self) -> int:
        return len(self.input_ids)

    @property
    def output_len(self) -> int:
        return self.sampling_params.max_tokens


def validate_pending(uid: int, input_len: int, params: SamplingParams) -> None:
    """A clear error naming the bad field (also used by `fast`)."""
    if input_len < 1:
        raise ValueError(f"request {uid}: input_ids is empty")
    if params.max_tokens < 1:
        raise ValueError(f"request {uid}: max_tokens must be >= 1, got {params.max_tokens}")
