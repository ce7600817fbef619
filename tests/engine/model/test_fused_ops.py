"""The fused Triton kernels of the CUDA path against the torch layers they replace (float32 and,
on a GPU, bfloat16). On the GPU when there is one, else under Triton's CPU interpreter when
Triton is installed (tests/conftest.py sets
TRITON_INTERPRET); skipped otherwise (CI has neither)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from kvledger.engine.model import fused_ops  # noqa: E402
from kvledger.engine.model.kv_pool import KVPool  # noqa: E402
from kvledger.engine.model.layers import RMSNorm, RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _close(a, b, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)
    assert err < tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g).to(DEVICE, dtype)
    res = torch.randn(7, 96, generator=g).to(DEVICE, dtype) if with_residual else None
    norm = RMSNorm(96, 1e-6).to(DEVICE, dtype)
    norm.weight.data = torch.randn(96, generator=g).to(DEVICE, dtype)
    out, new_res = fused_ops.add_rmsnorm(x, res, norm.weight, norm.eps)
    total = x + res if with_residual else x
    _close(new_res, total, dtype)
    _close(out, norm(total), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (9, 3)])  # 9 + 3 rows pad to 16 and 3 KV heads to 4
def test_qk_norm_rope_store(dtype, qk_norm, heads, kv_heads):
    g = torch.Generator().manual_seed(1)
    t, dim = 5, 32
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g).to(DEVICE, dtype)
    positions = torch.tensor([0, 3, 17, 200, 4095], device=DEVICE)
    out_loc = torch.tensor([9, 2, 30, 11, 0], device=DEVICE)
    rotary = RotaryEmbedding(dim, 1e6)
    qn = RMSNorm(dim, 1e-6).to(DEVICE, dtype) if qk_norm else None
    kn = RMSNorm(dim, 1e-6).to(DEVICE, dtype) if qk_norm else None
    if qk_norm:
        qn.weight.data = torch.randn(dim, generator=g).to(DEVICE, dtype)
        kn.weight.data = torch.randn(dim, generator=g).to(DEVICE, dtype)
    pool = KVPool(1, 40, kv_heads, dim, dtype=dtype, device=DEVICE)
    q = fused_ops.qk_norm_rope_store(
        qkv,
        positions,
        rotary.inv_freq.to(DEVICE),
        qn.weight if qk_norm else None,
        kn.weight if qk_norm else None,
        1e-6,
        heads,
        kv_heads,
        pool.k[0],
        pool.v[0],
        pool.token_dim,
        out_loc,
    )
    q_ref, k_ref, v_ref = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q_ref, k_ref, v_ref = q_ref.view(t, heads, dim), k_ref.view(t, kv_heads, dim), v_ref.view(t, kv_heads, dim)
    if qk_norm:
        q_ref, k_ref = qn(q_ref), kn(k_ref)
    cos, sin = rotary.cos_sin(positions, dtype)
    q_ref, k_ref = RotaryEmbedding.rotate(q_ref, cos, sin), RotaryEmbedding.rotate(k_ref, cos, sin)
    _close(q, q_ref, dtype)
    k_got, v_got = pool.gather(0, out_loc)
    _close(k_got.transpose(0, 1), k_ref, dtype)
    assert torch.equal(v_got.transpose(0, 1), v_ref)
    untouched = torch.ones(41, dtype=torch.bool)
    untouched[out_loc.cpu()] = False
    assert not pool.k[0][:, untouched.to(DEVICE)].any()  # nothing written elsewhere
    assert not pool.v[0][:, untouched.to(DEVICE)].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    g = torch.Generator().manual_seed(2)
    gu = torch.randn(3, 2 * 1500, generator=g).to(DEVICE, dtype)
    gate, up = gu.chunk(2, dim=-1)
    _close(fused_ops.silu_mul(gu), torch.nn.functional.silu(gate) * up, dtype)
