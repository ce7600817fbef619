"""Requests with token ids held as int32 CPU tensors; the length bookkeeping is the model's."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvledger.reference.requests import PendingReq as _ModelPendingReq
from kvledger.reference.requests import Req as _ModelReq
from kvledger.reference.requests import SamplingParams, validate_pending

__all__ = ["ChunkedReq", "PendingReq", "Req", "SamplingParams", "as_token_tensor"]


def as_token_tensor(ids: Any) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise ValueError(f"input_ids must be 1-D, got shape {tuple(ids.shape)}")
        return ids.to(device="cpu", dtype=torch.int32)
    return torch.tensor(list(ids), dtype=torch.int32)


class Req(_ModelReq):
    """Token ids live in a buffer sized for the request's whole life: appending is one store.

    The buffer is a numpy array (a store into it costs ~0.1 us, into a tensor ~2 us: the engine
    stores one token per running request per step); `input_ids` is a tensor view of it.
    """

    def __init__(self, input_ids: Any, table_idx: int, cached_len: int, output_len: int, uid: int,
                 sampling_params: SamplingParams, cache_handle: Any) -> None:
        super().__init__(input_ids, table_idx, cached_len, output_len, uid, sampling_params, cache_handle)
        self._buf = np.empty(self.max_device_len, dtype=np.int32)
        self._buf[: len(input_ids)] = as_token_tensor(input_ids).numpy()
        self._len = len(input_ids)

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.from_numpy(self._buf[: self._len])

    @input_ids.setter
    def input_ids(self, ids: Any) -> None:
        # the model's constructor assigns input_ids before the buffer exists; ours fills it next
        if hasattr(self, "_buf"):
            raise AttributeError("input_ids grows only through append_host")

    def append_host(self, next_token: Any) -> None:
        if self._len >= self.max_device_len:
            raise RuntimeError(f"request {self.uid}: no room for another token ({self.max_device_len} max)")
        self._buf[self._len] = int(next_token)
        self._len += 1

    def set_host_token(self, index: int, token: Any) -> None:
        if not 0 <= index < self._len:
            raise IndexError(f"request {self.uid}: token index {index} outside [0, {self._len})")
        self._buf[index] = int(token)


class ChunkedReq(Req):
    @property
    def can_decode(self) -> bool:
        return False

    def append_host(self, next_token: Any) -> None:
        raise RuntimeError(f"request {self.uid}: a chunked prefill produces no token")


class PendingReq(_ModelPendingReq):
    """The model's pending request, with token ids held as an int32 CPU tensor."""

    def __post_init__(self) -> None:
        self.input_ids = as_token_tensor(self.input_ids)
        validate_pending(self.uid, len(self.input_ids), self.sampling_params)
