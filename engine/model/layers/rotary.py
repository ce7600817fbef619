import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Llama-style rotary embedding (rotate-half layout), positions given per token."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies. On the
        # CPU even under `torch.device("meta")` (from_state_dict): meta arithmetic imports torch._dynamo
        # and sympy, seconds of every start; cos_sin moves it to the positions' device.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
        self.inv_freq = 1.0 / (theta ** (exponents / head_dim))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, sin of shape [T, 1, head_dim]; computed once per step, shared by all layers."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]."""
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
