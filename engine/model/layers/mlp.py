from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvledger.engine.model.layers.linear import Linear

if TYPE_CHECKING:
    from kvledger.engine.distributed.group import TensorParallelGroup


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up projections fused into one matmul. Under tensor parallelism
    `intermediate_size` is this rank's share, and the down projection's output is summed over ranks."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out = self.down_proj(F.silu(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)
