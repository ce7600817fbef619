import torch
import torch.nn.functional as F
from torch import nn

from kvledger.engine.layers.linear import PackedWeight, linear


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """Hidden states -> logits; with tied embeddings it reads the embedding matrix."""

    def __init__(self, vocab_size: int, hidden_size: int, tie_to: Embedding | None = None) -> None:
        super().__init__()
        # Kept in a list so the tied embedding is not registered twice (no "lm_head.weight" key).
        self._tied = [tie_to] if tie_to is not None else []
        if tie_to is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self._packed = PackedWeight()  # oneDNN layout on the CPU (engine/layers/linear.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self._tied[0].weight if self._tied else self.weight, self._packed)
