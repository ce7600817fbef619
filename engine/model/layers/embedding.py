from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvledger.engine.model.layers.linear import PackedWeight, linear

if TYPE_CHECKING:
    from kvledger.engine.distributed.group import TensorParallelGroup


class Embedding(nn.Module):
    """Token ids -> hidden states. Under tensor parallelism each rank holds the vocabulary `rows`
    (a range), embeds the ids that fall in it, zeros the others, and the ranks' results are summed."""

    def __init__(
        self, vocab_size: int, hidden_size: int, rows: range | None = None, tp: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        self.rows = rows if rows is not None else range(vocab_size)
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(len(self.rows), hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None or self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.rows.start) | (ids >= self.rows.stop)
        local = (ids - self.rows.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(out)


class LMHead(nn.Module):
    """Hidden states -> logits; with tied embeddings it reads the embedding matrix. Under tensor
    parallelism each rank computes its vocabulary rows' logits and the ranks gather the whole row."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tie_to: Embedding | None = None,
        rows: range | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp
        # Kept in a list so the tied embedding is not registered twice (no "lm_head.weight" key).
        self._tied = [tie_to] if tie_to is not None else []
        if tie_to is None:
            self.weight = nn.Parameter(torch.empty(len(rows) if rows is not None else vocab_size, hidden_size))
        self._packed = PackedWeight()  # oneDNN layout on the CPU (engine/model/layers/linear.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = linear(x, self._tied[0].weight if self._tied else self.weight, self._packed)
        if self.tp is None or self.tp.size == 1:
            return logits
        return self.tp.gather_vocab(logits, self.vocab_size)
