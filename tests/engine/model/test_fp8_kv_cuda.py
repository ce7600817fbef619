"""The FP8 KV cache on CUDA: the Triton kernels that read e4m3 (split-KV decode, the unified
prefill/extend kernel) against a gathered oracle over the dequantized pool, the fused store kernel
against the pool's own quantizer, and the engine with CUDA graphs and overlap against its eager
serial self. `cuda`-marked: skipped without a CUDA device (CI has none)."""

from __future__ import annotations

import pytest
import torch

from kvledger.engine.attention.base import AttentionBatch
from kvledger.engine.model.kv_pool import FP8, KVPool
from tests.support.models import nano_like, tiny_qwen3

pytestmark = pytest.mark.cuda

DEVICE = "cuda"


def _pool(kv_heads, head_dim, tokens, k_scale, v_scale, g):
    pool = KVPool(
        1,
        tokens,
        kv_heads,
        head_dim,
        dtype=torch.bfloat16,
        device=DEVICE,
        kv_dtype=FP8,
        k_scales=[k_scale],
        v_scales=[v_scale],
    )
    k = torch.randn(kv_heads, tokens + 1, head_dim, generator=g) * k_scale * 40
    v = torch.randn(kv_heads, tokens + 1, head_dim, generator=g) * v_scale * 40
    pool.k[0].copy_(KVPool.quantize(k, k_scale).to(DEVICE))
    pool.v[0].copy_(KVPool.quantize(v, v_scale).to(DEVICE))
    return pool


def _oracle(pool, q, batch, heads, kv_heads):
    outs, t = [], 0
    for i, (cached, seq) in enumerate(zip(batch.cached_lens, batch.seq_lens)):
        n, locs = seq - cached, batch.locs[i, :seq]
        k, v = pool.gather(0, locs)
        k = k.float().repeat_interleave(heads // kv_heads, 0)
        v = v.float().repeat_interleave(heads // kv_heads, 0)
        qi = q[t : t + n].float().transpose(0, 1)
        mask = torch.arange(seq, device=q.device)[None, :] <= torch.arange(cached, seq, device=q.device)[:, None]
        outs.append(torch.nn.functional.scaled_dot_product_attention(qi, k, v, attn_mask=mask).transpose(0, 1))
        t += n
    return torch.cat(outs)


@pytest.mark.parametrize("seed", range(3))
def test_fp8_decode_kernel_matches_the_dequantized_oracle(seed):
    from kvledger.engine.attention.triton_decode import DecodeWorkspace, decode_attention

    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim = [(9, 3, 64), (16, 8, 128), (16, 2, 64)][seed]
    seq = [1, 2, 63, 64, 65, 290]
    width = max(seq)
    table = torch.zeros(len(seq) + 1, width, dtype=torch.int32)
    perm = torch.randperm(len(seq) * width, generator=g)
    for r in range(len(seq)):
        table[r + 1] = perm[r * width : (r + 1) * width]
    pool = _pool(kv_heads, head_dim, len(seq) * width, [0.01, 0.05, 0.003][seed], [0.02, 0.004, 0.1][seed], g)
    table = table.to(DEVICE)
    rows = torch.arange(1, len(seq) + 1, device=DEVICE)
    batch = AttentionBatch.from_page_table(table, rows.tolist(), [s - 1 for s in seq], seq)
    q = torch.randn(len(seq), heads, head_dim, generator=g).to(DEVICE, torch.bfloat16)
    expected = _oracle(pool, q, batch, heads, kv_heads)
    ws = DecodeWorkspace(8, heads, head_dim, 16, DEVICE)
    seq_t = torch.tensor(seq, dtype=torch.int32, device=DEVICE)
    for splits in (1, 4, 16):
        out = decode_attention(
            q,
            pool.k[0],
            pool.v[0],
            pool.token_dim,
            table,
            rows,
            seq_t,
            ws,
            splits,
            k_scale=pool.k_scale[0],
            v_scale=pool.v_scale[0],
        )
        err = (out.float() - expected).norm() / expected.norm()
        assert not torch.isnan(out).any() and err < 2e-2, f"{splits} splits: relative error {err:.2e}"


def test_fp8_prefill_kernel_stores_quantized_kv_and_attends_over_it():
    from kvledger.engine.attention.triton_paged import TritonPagedBackend

    g = torch.Generator().manual_seed(4)
    heads, kv_heads, head_dim = 8, 2, 64
    seq, cached = [40, 90, 7], [0, 30, 6]
    width = max(seq)
    table = torch.arange(len(seq) * width, dtype=torch.int32).view(len(seq), width)
    pool = _pool(kv_heads, head_dim, len(seq) * width, 0.02, 0.01, g)
    batch = AttentionBatch.from_page_table(table.to(DEVICE), [0, 1, 2], cached, seq)
    t = sum(s - c for s, c in zip(seq, cached))
    q = torch.randn(t, heads, head_dim, generator=g).to(DEVICE, torch.bfloat16)
    k = (torch.randn(t, kv_heads, head_dim, generator=g) * 0.5).to(DEVICE, torch.bfloat16)
    v = (torch.randn(t, kv_heads, head_dim, generator=g) * 0.3).to(DEVICE, torch.bfloat16)
    backend = TritonPagedBackend()
    backend.configure(heads, kv_heads, head_dim)
    backend.plan(batch)
    out = backend.forward(q, k, v, 0, pool)
    stored_k, _ = pool.gather(0, batch.out_loc)
    assert torch.equal(stored_k, pool.round_trip(0, k, v)[0].transpose(0, 1))
    expected = _oracle(pool, q, batch, heads, kv_heads)
    err = (out.float() - expected).norm() / expected.norm()
    assert err < 2e-2, f"relative error {err:.2e}"


def test_the_fused_store_kernel_writes_what_the_pool_quantizer_writes():
    from kvledger.engine.model import fused_ops

    g = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, t = 8, 2, 64, 33
    pool = KVPool(
        1, 64, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE, kv_dtype=FP8, k_scales=[0.01], v_scales=[0.003]
    )
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, torch.bfloat16)
    positions = torch.arange(t, device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    out_loc = torch.randperm(64, generator=g)[:t].to(DEVICE)
    fused_ops.qk_norm_rope_store(
        qkv,
        positions,
        inv_freq,
        None,
        None,
        0.0,
        heads,
        kv_heads,
        pool.k[0],
        pool.v[0],
        pool.token_dim,
        out_loc,
        0.01,
        0.003,
    )
    v = qkv[:, (heads + kv_heads) * head_dim :].view(t, kv_heads, head_dim)
    want = KVPool.quantize(v.transpose(0, 1), 0.003)
    got = pool.v[0][:, out_loc]
    same = (got.view(torch.uint8) == want.view(torch.uint8)).float().mean()
    assert same > 0.999, f"{same:.4f} of the V bytes agree"  # at most a rounding tie apart


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_fp8_engine_with_graphs_and_overlap_matches_its_eager_serial_self(dtype):
    from kvledger.engine.runtime.llm import LLM

    cfg = tiny_qwen3()
    prompts, params = nano_like(40, seed=0)
    kw = dict(
        dummy_weights=True,
        device="cuda",
        dtype=dtype,
        kv_cache_dtype="fp8_e4m3",
        page_size=16,
        kv_cache_tokens=20000,
        max_running_req=40,
        max_seq_len=512,
        max_prefill_tokens=512,
    )
    with LLM(cfg, cuda_graphs=False, overlap=False, **kw) as eager:
        assert eager.model.kv_pool.quantized
        expected = [o.token_ids for o in eager.generate(prompts, params)]
    with LLM(cfg, cuda_graphs=True, overlap=True, verify=True, **kw) as fast_llm:
        got = [o.token_ids for o in fast_llm.generate(prompts, params)]
    assert got == expected
