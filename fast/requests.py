"""Requests with token ids held as int32 CPU tensors, and their own length bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Sequence

import numpy as np
import torch

from kvledger.reference.requests import SamplingParams, validate_pending

__all__ = ["ChunkedReq", "PendingReq", "Req", "SamplingParams", "as_token_tensor"]


def as_token_tensor(ids: Any) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise ValueError(f"input_ids must be 1-D, got shape {tuple(ids.shape)}")
        return ids.to(device="cpu", dtype=torch.int32)
    # through numpy: torch.tensor() checks each element's type, ~5x slower for a 2k-token list
    return torch.from_numpy(np.asarray(list(ids), dtype=np.int32))


class Req:
    """An admitted request. Token ids live in a buffer sized for its whole life: appending is one
    store. The buffer is a numpy array (a store into it costs ~0.1 us, into a tensor ~2 us: the
    engine stores one token per running request per step); `input_ids` is a tensor view of it.

    The length bookkeeping is written here again, not inherited from the reference: a bug in
    the model's arithmetic must show up as a difference, not be shared by both sides.
    """

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
        ids = as_token_tensor(input_ids).numpy()
        n = int(ids.shape[0])
        if not 0 <= cached_len < n or output_len < 0:
            raise ValueError(
                f"request {uid}: need 0 <= cached_len ({cached_len}) < device_len ({n}) "
                f"<= max_device_len ({n + output_len})"
            )
        self.table_idx = table_idx
        self.cached_len = cached_len
        self.device_len = n
        self.output_len = output_len
        self.max_device_len = n + output_len
        self.uid = uid
        self.sampling_params = sampling_params
        self.cache_handle = cache_handle
        self._buf = np.empty(self.max_device_len, dtype=np.int32)
        self._buf[:n] = ids
        self._len = n
        self.drafts: List[int] = []  # tokens this step verifies after the last one (speculation)

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.from_numpy(self._buf[: self._len])

    @property
    def remain_len(self) -> int:
        return self.max_device_len - self.device_len

    @property
    def extend_len(self) -> int:
        return self.device_len - self.cached_len

    @property
    def can_decode(self) -> bool:
        return self.device_len < self.max_device_len

    def complete_one(self) -> None:
        """This step's positions have KV now; the next step computes the one after them."""
        self.cached_len, self.device_len = self.device_len, self.device_len + 1

    def append_host(self, next_token: Any) -> None:
        if self._len >= self.max_device_len:
            raise RuntimeError(f"request {self.uid}: no room for another token ({self.max_device_len} max)")
        self._buf[self._len] = int(next_token)
        self._len += 1

    # -- speculative decoding (the reference's `Req` says what each does) ------------------------
    @property
    def draft_room(self) -> int:
        return max(self.max_device_len - self.device_len - 1, 0)

    def propose(self, drafts: Sequence[int]) -> None:
        if self.drafts:
            raise RuntimeError(f"request {self.uid}: drafts proposed twice in one step")
        if len(drafts) > self.draft_room:
            raise ValueError(f"request {self.uid}: {len(drafts)} drafts, room for {self.draft_room}")
        self.drafts = [int(t) for t in drafts]
        self.device_len += len(self.drafts)

    def verify(self, accepted: int, bonus: int) -> int:
        """Commit the first `accepted` drafts and `bonus`; returns the end of the step's locations."""
        k = len(self.drafts)
        if not 0 <= accepted <= k:
            raise ValueError(f"request {self.uid}: {accepted} drafts accepted of {k}")
        reserved_end, base = self.device_len, self.device_len - k
        for token in self.drafts[:accepted] + [int(bonus)]:
            self.append_host(token)
        self.cached_len = base + accepted
        self.device_len = self.cached_len + 1
        self.drafts = []
        return reserved_end

    def set_host_token(self, index: int, token: Any) -> None:
        if not 0 <= index < self._len:
            raise IndexError(f"request {self.uid}: token index {index} outside [0, {self._len})")
        self._buf[index] = int(token)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(uid={self.uid}, table_idx={self.table_idx}, cached_len={self.cached_len}, "
            f"device_len={self.device_len}, max_device_len={self.max_device_len})"
        )


class ChunkedReq(Req):
    @property
    def can_decode(self) -> bool:
        return False

    def append_host(self, next_token: Any) -> None:
        raise RuntimeError(f"request {self.uid}: a chunked prefill produces no token")


@dataclass(eq=False)
class PendingReq:
    """A request waiting for admission, its token ids an int32 CPU tensor."""

    uid: int
    input_ids: torch.Tensor
    sampling_params: SamplingParams
    chunked_req: Req | None = None

    def __post_init__(self) -> None:
        self.input_ids = as_token_tensor(self.input_ids)
        validate_pending(self.uid, len(self.input_ids), self.sampling_params)

    @property
    def input_len(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def output_len(self) -> int:
        return self.sampling_params.max_tokens
