"""Per-layer FP8 KV scales, calibrated from the model's own K and V on a fixed input.

e4m3 keeps about 3 mantissa bits over magnitudes 2^-6 .. 448 (subnormals below): with a scale
of 1.0, half of SmolLM2's first-layer V values fall under 2^-6 and lose most of their bits. So
before serving, the engine runs the calibration tokens once through an unquantized pool and sets
each layer's scale to twice its absolute maximum over 448 (headroom for inputs larger than the
calibration's; stores clamp at +-448, never overflowing to NaN). The input is seeded random token
ids, so a model without a tokenizer calibrates alike and a run replays exactly.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from kvledger.engine.attention.base import AttentionBatch
from kvledger.engine.model.kv_pool import FP8_MAX, KVPool

CALIBRATION_TOKENS = 512
HEADROOM = 2.0


def calibration_ids(vocab_size: int, n: int = CALIBRATION_TOKENS, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def calibrate_kv_scales(model, ids: torch.Tensor) -> Tuple[List[float], List[float]]:
    """Run `ids` through `model` (one prefill) over a temporary pool in the model's dtype; return
    per-layer (k_scales, v_scales). The model's own pool is put back."""
    own = model.kv_pool
    n = len(ids)
    device = own.device
    probe = KVPool(len(own.k), n, own.k[0].shape[0], own.k[0].shape[-1], own.compute_dtype, device)
    table = torch.arange(n, dtype=torch.int32, device=device).view(1, n)
    attn = AttentionBatch.from_page_table(table, [0], [0], [n])
    model.kv_pool = probe
    try:
        model(ids.to(device), attn.positions, attn)
    finally:
        model.kv_pool = own
    k_scales = [_scale(probe.k[layer][:, :n]) for layer in range(len(probe.k))]
    v_scales = [_scale(probe.v[layer][:, :n]) for layer in range(len(probe.v))]
    return k_scales, v_scales


def _scale(x: torch.Tensor) -> float:
    peak = float(x.float().abs().max())
    return max(peak * HEADROOM / FP8_MAX, 1e-8)
