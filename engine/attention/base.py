"""Attention interface: per-step batch metadata plus a per-layer backend call."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvledger.engine.model.kv_pool import KVPool


@dataclass
class AttentionBatch:
    """What attention needs for one step over a flat batch of T new tokens.

    Request i owns new tokens [q_start[i], q_start[i] + q_lens[i]) of the flat batch, at
    positions [cached_lens[i], seq_lens[i]); its whole sequence lives in the KV pool at
    locs[i, :seq_lens[i]].
    """

    q_lens: list[int]
    seq_lens: list[int]  # total length, including the new tokens
    cached_lens: list[int]  # prefix positions already in the pool
    locs: torch.Tensor  # [B, max(seq_lens)] int64 token locations; padding is 0
    out_loc: torch.Tensor  # [T] int64, where the new tokens' K/V go
    positions: torch.Tensor  # [T] int64, position of each new token
    last_token_idx: torch.Tensor  # [B] int64, index in T of each request's last new token
    table: torch.Tensor | None = None  # the request-to-token table the rows index (decode kernels read it)
    rows: torch.Tensor | None = None  # [B] int64 table row of each request
    may_share: bool = True  # False: no request shares KV pages with another (no cascade attention)

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.out_loc.numel())

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.q_lens)

    @classmethod
    def from_page_table(
        cls,
        page_table: torch.Tensor,
        table_idx: Sequence[int],
        cached_lens: Sequence[int],
        seq_lens: Sequence[int],
    ) -> AttentionBatch:
        """Build from the scheduler's request-to-token table.

        page_table: [rows, max_seq_len] int32 token locations (page size 1).
        table_idx: the table row of each request in the batch.
        cached_lens: per request, prefix positions already in the pool.
        seq_lens: per request, length on the device after this step (cached + new tokens).
        """
        cached_lens, seq_lens = list(cached_lens), list(seq_lens)
        q_lens = [s - c for s, c in zip(seq_lens, cached_lens)]
        if any(n <= 0 for n in q_lens):
            raise ValueError(f"every request needs at least one new token: {cached_lens=} {seq_lens=}")
        device = page_table.device
        max_len = max(seq_lens)
        rows = torch.as_tensor(list(table_idx), dtype=torch.long, device=device)
        locs = page_table[rows, :max_len].long()
        col = torch.arange(max_len, device=device)
        seq = torch.as_tensor(seq_lens, device=device)[:, None]
        cached = torch.as_tensor(cached_lens, device=device)[:, None]
        locs = torch.where(col < seq, locs, 0)  # table entries past seq_len may be stale
        new = (col >= cached) & (col < seq)  # row-major order = request by request, positions ascending
        return cls(
            q_lens=q_lens,
            seq_lens=seq_lens,
            cached_lens=cached_lens,
            locs=locs,
            out_loc=locs[new],
            positions=col.expand_as(locs)[new],
            last_token_idx=torch.as_tensor(q_lens, device=device).cumsum(0) - 1,
            table=page_table,
            rows=rows,
        )


class AttentionBackend(ABC):
    """configure() once for the model, plan() once per step, then forward() once per layer."""

    # True for a backend with forward_stored(q, layer, pool): attention once the layer's K/V are
    # already in the pool, which the fused norm/rope/KV-store kernels write themselves
    reads_stored_kv: bool = False

    def configure(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:  # noqa: B027 (optional)
        """The attention shape of the model this backend serves (this rank's heads); `CausalLM`
        calls it when the backend is set, so per-step work (workspaces, split counts, groups) is
        done in `plan`, never inside a layer."""

    @abstractmethod
    def plan(self, batch: AttentionBatch) -> None: ...

    def forward_stored(self, q: torch.Tensor, layer: int, pool: KVPool) -> torch.Tensor:
        """Attention once this step's K/V are in the pool (a backend that `reads_stored_kv`)."""
        raise NotImplementedError(f"{type(self).__name__} does not read stored KV")

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, pool: KVPool) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] for the new tokens.

        Stores k, v at the batch's out_loc, then returns causal attention of the new tokens
        over prefix + new KV, shape [T, heads, head_dim].
        """
