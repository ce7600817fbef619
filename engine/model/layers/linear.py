"""Linear layers that run CPU matmuls through oneDNN with a pre-packed weight.

torch's float32 `F.linear` on the CPU calls MKL's sgemm, which on this AMD EPYC (Zen 5) takes its
AVX2 code path: ~210 GFLOP/s on two cores at prefill sizes and ~100 at decode sizes, while oneDNN
(which picks its kernels from the CPU's feature flags, not its vendor) runs AVX-512 at ~480 and
~170-230 (notes/cpu-throughput.md). oneDNN also prefers its own blocked weight layout: packing
the weight once ("reorder") instead of on every call is 1.3-1.6x faster again at decode sizes,
and still helps bfloat16 (whose `F.linear` already goes to oneDNN, unpacked) by ~1.25x there.

The packed copy is kept next to the parameter (not in the state dict) and repacked when the
parameter is replaced or changed in place. Everything else (CUDA, autograd, other dtypes, a
torch without oneDNN) goes through `F.linear`. Results agree with `F.linear` to float rounding
(a different summation order), not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_PACK_HINT = 64  # oneDNN's batch-size hint when packing; the packed weight serves any batch size
_DTYPES = (torch.float32, torch.bfloat16)


def _probe(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs for `dtype` here (bfloat16 needs AVX-512 or AVX-NE-CONVERT)."""
    try:
        op, reorder = torch.ops.mkldnn._linear_pointwise, torch.ops.mkldnn._reorder_linear_weight
        if not torch.backends.mkldnn.is_available():
            return False
        w, x = torch.randn(8, 16).to(dtype), torch.randn(4, 16).to(dtype)
        return torch.allclose(
            op(x, reorder(w, 4), None, "none", [], "").float(),
            F.linear(x, w).float(),
            atol=1e-5 if dtype == torch.float32 else 3e-2,
        )
    except Exception:  # an op missing or failing in this torch build or on this CPU
        return False


ONEDNN_DTYPES = frozenset(d for d in _DTYPES if _probe(d))
ONEDNN = bool(ONEDNN_DTYPES)


class PackedWeight:
    """A oneDNN-packed copy of one CPU weight, rebuilt when the weight is replaced or modified."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._packed: torch.Tensor | None = None

    @staticmethod
    def _key_of(weight: torch.Tensor) -> tuple:
        try:
            version = weight._version
        except RuntimeError:  # an inference tensor has no version counter
            version = None
        return (weight, weight.data_ptr(), version)

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = self._key_of(weight)
        if self._key is None or self._key[0] is not weight or self._key[1:] != key[1:]:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_HINT)
            self._key = key
        return self._packed  # type: ignore[return-value]


def linear(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """`F.linear(x, weight)` without bias; on the CPU for float32/bfloat16 inference, through oneDNN."""
    if (
        not ONEDNN
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or x.dtype not in ONEDNN_DTYPES
        or weight.dtype != x.dtype
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return F.linear(x, weight)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.get(weight), None, "none", [], "")


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state-dict keys) whose CPU inference runs through oneDNN."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, **kwargs) -> None:
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self._packed = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return F.linear(x, self.weight, self.bias)
        return linear(x, self.weight, self._packed)
