"""The Triton GEMMs of kvledger/bench/triton_linear.py against torch: the plain product, the
gated gate/up + SiLU product, and split-K (deterministic, its tile counters left at zero). On the
GPU in bfloat16 when there is one, else in float32 under Triton's CPU interpreter (tests/conftest.py
sets TRITON_INTERPRET); skipped without Triton."""

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from kvledger.bench import triton_linear  # noqa: E402
from kvledger.bench.triton_linear import GemmLaunch, gated_linear, linear  # noqa: E402
from kvledger.engine.model import fused_ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TOL = 2e-2 if DTYPE == torch.bfloat16 else 1e-5
SMALL = GemmLaunch(16, 32, 32, 4, 2)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _inputs(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, DTYPE)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(DEVICE, DTYPE)
    return x, w


@pytest.mark.parametrize("m,n,k", [(37, 96, 64), (5, 40, 80), (64, 64, 96)])  # 80 and 96: a partial K block
def test_linear_matches_torch(m, n, k):
    x, w = _inputs(m, n, k, seed=m + n + k)
    out = linear(x, w, SMALL)
    assert not out.isnan().any()
    assert _err(out, F.linear(x.float(), w.float())) < TOL


def test_gated_linear_matches_linear_then_silu_mul():
    m, inter, k = 19, 48, 64
    x, w = _inputs(m, 2 * inter, k, seed=1)
    got = gated_linear(x, w, SMALL)
    gate_up = F.linear(x.float(), w.float()).to(DTYPE)
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert got.shape == (m, inter)
    assert _err(got, (F.silu(gate) * up).to(DTYPE)) < TOL
    if DEVICE == "cuda":  # the unfused engine path: same roundings, another summation order
        assert _err(got, fused_ops.silu_mul(gate_up)) < TOL


@pytest.mark.parametrize("splits", [2, 3])
def test_split_k_matches_and_is_deterministic(splits):
    m, n, k = 33, 64, 32 * splits * 2
    x, w = _inputs(m, n, k, seed=splits)
    launch = GemmLaunch(16, 32, 32, 4, 2, splits=splits)
    first, second = linear(x, w, launch), linear(x, w, launch)
    assert _err(first, F.linear(x.float(), w.float())) < TOL
    assert torch.equal(first, second)  # partials summed in slice order, whichever program ends last
    assert not triton_linear._counters(x.device, 1).any()  # every tile's counter back at zero


def test_split_k_refuses_a_k_it_cannot_slice():
    x, w = _inputs(8, 32, 96, seed=3)
    with pytest.raises(ValueError, match="does not split"):
        linear(x, w, GemmLaunch(16, 32, 32, 4, 2, splits=2))
    with pytest.raises(ValueError, match="no split-K"):
        gated_linear(x, w, GemmLaunch(16, 32, 32, 4, 2, splits=3))
