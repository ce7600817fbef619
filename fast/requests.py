"""Requests with token ids held as int32 CPU tensors; the length bookkeeping is the model's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from reference.requests import Req as _ModelReq
from reference.requests import SamplingParams, validate_pending

__all__ = ["ChunkedReq", "PendingReq", "Req", "SamplingParams", "as_token_tensor"]


def as_token_tensor(ids: Any) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise ValueError(f"input_ids must be 1-D, got shape {tuple(ids.shape)}")
        return ids.to(device="cpu", dtype=torch.int32)
    return torch.tensor(list(ids), dtype=torch.int32)


class Req(_ModelReq):
    def append_host(self, next_token: Any) -> None:
        token = torch.as_tensor(next_token, dtype=torch.int32).reshape(1)
        self.input_ids = torch.cat([self.input_ids, token])


class ChunkedReq(Req):
    @property
    def can_decode(self) -> bool:
        return False

    def append_host(self, next_token: Any) -> None:
        raise RuntimeError(f"request {self.uid}: a chunked prefill produces no token")


@dataclass(eq=False)
class PendingReq:
    uid: int
    input_ids: Any  # anything token-like; stored as an int32 CPU tensor
    sampling_params: SamplingParams
    chunked_req: Req | None = None

    def __post_init__(self) -> None:
        self.input_ids = as_token_tensor(self.input_ids)
        validate_pending(self.uid, len(self.input_ids), self.sampling_params)

    @property
    def input_len(self) -> int:
        return len(self.input_ids)

    @property
    def output_len(self) -> int:
        return self.sampling_params.max_tokens
