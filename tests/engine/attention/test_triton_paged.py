"""The Triton paged-attention kernel against a gathered-KV SDPA oracle: random shapes, page
sizes, prefix hits and lengths, float32 and bfloat16. On the GPU when there is one, else under
Triton's CPU interpreter when Triton is installed (tests/conftest.py sets
TRITON_INTERPRET); skipped otherwise (CI has neither)."""

import itertools

import pytest
import torch

triton = pytest.importorskip("triton")

from kvledger.engine.attention.base import AttentionBatch  # noqa: E402
from kvledger.engine.attention.triton_paged import TritonPagedBackend  # noqa: E402
from kvledger.engine.model.kv_pool import KVPool  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bfloat16 needs the GPU: Triton's CPU interpreter does not emulate bfloat16 dot products
DTYPES = [
    pytest.param(torch.float32, 1e-4, id="float32"),
    pytest.param(torch.bfloat16, 1e-2, marks=pytest.mark.cuda, id="bfloat16"),
]


def _oracle(pool: KVPool, q, batch: AttentionBatch, heads: int, kv_heads: int):
    head_major = pool.token_dim == 1
    outs, t = [], 0
    for i, (cached, seq) in enumerate(zip(batch.cached_lens, batch.seq_lens)):
        n, locs = seq - cached, batch.locs[i, :seq]
        take = (lambda x: x[:, locs]) if head_major else (lambda x: x[locs].transpose(0, 1))
        k = take(pool.k[0]).float().repeat_interleave(heads // kv_heads, 0)
        v = take(pool.v[0]).float().repeat_interleave(heads // kv_heads, 0)
        qi = q[t : t + n].float().transpose(0, 1)
        mask = torch.arange(seq, device=q.device)[None, :] <= torch.arange(cached, seq, device=q.device)[:, None]
        outs.append(torch.nn.functional.scaled_dot_product_attention(qi, k, v, attn_mask=mask).transpose(0, 1))
        t += n
    return torch.cat(outs)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("seed", range(3))
def test_matches_gathered_sdpa(dtype, tol, seed):
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads = [(4, 2), (8, 8), (6, 2)][seed]
    head_dim = [32, 64, 64][seed]
    page_size = [1, 4, 16][seed]
    batch_size = 5
    seq = torch.randint(1, 90, (batch_size,), generator=g).tolist()
    cached = [int(torch.randint(0, s, (1,), generator=g)) for s in seq]  # prefix hits of any length
    cached[0] = seq[0] - 1  # a decode row
    cached[1] = 0  # a fresh prefill
    pages_per_row = -(-max(seq) // page_size)
    num_pages = batch_size * pages_per_row + 3
    perm = torch.randperm(num_pages, generator=g)
    page_table = torch.zeros(batch_size + 2, pages_per_row * page_size, dtype=torch.int32)
    for r in range(batch_size):  # scattered pages, contiguous tokens inside a page
        pages = perm[r * pages_per_row : (r + 1) * pages_per_row]
        page_table[r + 2] = (pages[:, None] * page_size + torch.arange(page_size)).flatten()
    pool = KVPool(1, num_pages * page_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    pool.k_buffer.normal_(generator=None)
    pool.v_buffer.normal_(generator=None)
    batch = AttentionBatch.from_page_table(page_table.to(DEVICE), [r + 2 for r in range(batch_size)], cached, seq)
    t = sum(s - c for s, c in zip(seq, cached))
    q = torch.randn(t, heads, head_dim, generator=g).to(DEVICE, dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    backend = TritonPagedBackend()
    backend.configure(heads, kv_heads, head_dim)
    backend.plan(batch)
    out = backend.forward(q, k, v, 0, pool)
    expected = _oracle(pool, q, batch, heads, kv_heads)
    assert not torch.isnan(out).any()
    err = (out.float() - expected).norm() / expected.norm()
    assert err < tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("seed", range(3))
def test_split_kv_decode_matches_gathered_sdpa(dtype, tol, seed):
    """The split-KV decode kernel (every split count) reads each request's tokens through its
    table row; lengths from 1 to past several splits, GQA groups 1, 2, 3 and 8."""
    from kvledger.engine.attention.triton_decode import DecodeWorkspace, decode_attention, longest_first

    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim = [(9, 3, 64), (16, 8, 128), (16, 2, 64)][seed]
    page_size = [1, 16, 4][seed]
    batch_size = 6
    seq = [1, 2, 63, 64, 65] + [int(torch.randint(66, 300, (1,), generator=g))]
    pages_per_row = -(-max(seq) // page_size)
    num_pages = batch_size * pages_per_row + 2
    perm = torch.randperm(num_pages, generator=g)
    table = torch.zeros(batch_size + 1, pages_per_row * page_size, dtype=torch.int32)
    for r in range(batch_size):
        pages = perm[r * pages_per_row : (r + 1) * pages_per_row]
        table[r + 1] = (pages[:, None] * page_size + torch.arange(page_size)).flatten()
    pool = KVPool(1, num_pages * page_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    pool.k_buffer.normal_()
    pool.v_buffer.normal_()
    table = table.to(DEVICE)
    rows = torch.arange(1, batch_size + 1, device=DEVICE)
    batch = AttentionBatch.from_page_table(table, rows.tolist(), [s - 1 for s in seq], seq)
    q = torch.randn(batch_size, heads, head_dim, generator=g).to(DEVICE, dtype)
    expected = _oracle(pool, q, batch, heads, kv_heads)
    ws = DecodeWorkspace(8, heads, head_dim, 16, DEVICE)
    seq_t = torch.tensor(seq, dtype=torch.int32, device=DEVICE)
    order = longest_first(seq_t)
    # every block masked, or only the last partial one with int32 offsets (the FP8 launch's way)
    for splits, fast_blocks in itertools.product((1, 2, 16), (False, True)):
        outs = []
        for launch_order in (None, order):  # batch order, then longest first: the same function
            # the workspace and the output start as NaN: a partial or a row nobody wrote shows
            ws.part_o.fill_(float("nan"))
            ws.part_lse.fill_(float("nan"))
            out = torch.full_like(q, float("nan"))
            decode_attention(
                q, pool.k[0], pool.v[0], pool.token_dim, table, rows, seq_t, ws, splits, out=out, order=launch_order,
                mask_tail_only=fast_blocks, narrow=fast_blocks,
            )  # fmt: skip
            case = f"{splits} splits, order {launch_order}, tail-only masks {fast_blocks}"
            assert not torch.isnan(out).any(), f"{case}: a row was not written"
            err = (out.float() - expected).norm() / expected.norm()
            assert err < tol, f"{case}: relative error {err:.2e}"
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), f"{splits} splits: the launch order changed the output"
    # the backend picks the decode kernel for a pure-decode batch
    backend = TritonPagedBackend()
    backend.configure(heads, kv_heads, head_dim)
    backend.plan(batch)
    assert backend._decode is not None
    k_new, v_new = pool.gather(0, batch.out_loc)
    out = backend.forward(q, k_new.transpose(0, 1), v_new.transpose(0, 1), 0, pool)
    err = (out.float() - expected).norm() / expected.norm()
    assert err < tol, f"backend decode path: relative error {err:.2e}"


def test_narrow_offsets_only_below_int32_range():
    """int32 token offsets are used only while every element offset of a layer's pool fits: one more
    element would wrap them and read another token's K/V."""
    from kvledger.engine.attention.triton_decode import narrow_offsets

    assert narrow_offsets(torch.empty(2**31 - 1, dtype=torch.float8_e4m3fn, device="meta"))
    assert not narrow_offsets(torch.empty(8, 2**28, dtype=torch.float8_e4m3fn, device="meta"))
