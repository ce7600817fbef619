"""The CUDA C++ FP8 decode kernel (`cuda_fp8_decode`) against float32 attention over the dequantized
pool and against the Triton kernel: split counts, tile edges, empty splits, query groups, output
dtypes, a strided query, shared-prefix groups and CUDA-graph replay. Needs a CUDA device of sm_89 or later and NVRTC;
skipped elsewhere (CI)."""

from __future__ import annotations

import pytest
import torch

from kvledger.engine.attention import cuda_fp8_decode as cuda

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(cuda.available() is not None, reason=f"CUDA FP8 decode kernel: {cuda.available()}"),
]

FP8 = torch.float8_e4m3fn


def make_pool(lens, kv_heads, head_dim, seed):
    """A head-major e4m3 pool with each request's tokens at random, distinct locations."""
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lens) + 8
    perm = torch.randperm(tokens, generator=g)
    width = max(lens) + 5  # a table wider than any request: the kernel must stop at seq_len
    table = torch.full((len(lens), width), tokens - 1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(lens):
        table[b, :n] = perm[at : at + n]
        at += n
    kf = torch.randn(kv_heads, tokens, head_dim, generator=g) * 2
    vf = torch.randn(kv_heads, tokens, head_dim, generator=g)
    ks, vs = float(kf.abs().max() / 448), float(vf.abs().max() / 448)
    k, v = (kf / ks).to(FP8).cuda(), (vf / vs).to(FP8).cuda()
    return table.cuda(), k, v, ks, vs


def truth(q, k, v, ks, vs, table, lens):
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // k.shape[0]
    outs = []
    for b, n in enumerate(lens):
        locs = table[b, :n].long()
        kk = (k[:, locs].float() * ks).repeat_interleave(group, 0)
        vv = (v[:, locs].float() * vs).repeat_interleave(group, 0)
        scores = torch.einsum("hd,hnd->hn", q[b].float(), kk) * head_dim**-0.5
        outs.append(torch.einsum("hn,hnd->hd", scores.softmax(-1), vv))
    return torch.stack(outs)


def run(q, k, v, ks, vs, table, lens, splits, stage1, order=True):
    from kvledger.engine.attention.triton_decode import DecodeWorkspace, decode_attention, longest_first

    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ws = DecodeWorkspace(len(lens), q.shape[1], q.shape[2], 16, "cuda")
    rows = torch.arange(len(lens), device="cuda")
    return decode_attention(
        q, k, v, 1, table, rows, seq, ws, splits, k_scale=ks, v_scale=vs,
        order=longest_first(seq) if order else None, stage1=stage1,
    )  # fmt: skip


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


# lengths around the 64-token tile and the 16-token pass, a 1-token request, and a long one
LENS = [1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 200, 700, 1500]


@pytest.mark.parametrize("splits", [1, 2, 8])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(16, 8, 128), (9, 3, 64), (32, 8, 128), (8, 8, 128), (24, 3, 128)],
    ids=["g2", "g3d64", "g4", "g1", "g8"],
)
def test_matches_float32_attention_and_the_triton_kernel(splits, heads, kv_heads, head_dim):
    table, k, v, ks, vs = make_pool(LENS, kv_heads, head_dim, seed=splits + heads)
    q = torch.randn(len(LENS), heads, head_dim, device="cuda", dtype=torch.bfloat16)
    want = truth(q, k, v, ks, vs, table, LENS)
    got = run(q, k, v, ks, vs, table, LENS, splits, "cuda")
    tri = run(q, k, v, ks, vs, table, LENS, splits, "triton")
    # per request, so that an error in one short request is not averaged away
    for b in range(len(LENS)):
        assert rel(got[b], want[b]) < 1e-2, (LENS[b], rel(got[b], want[b]))
    assert rel(got, tri) < 1e-2


def test_fp16_query_and_unordered_batch():
    lens = [3, 64, 300, 65, 1]
    table, k, v, ks, vs = make_pool(lens, 8, 128, seed=7)
    q = torch.randn(len(lens), 16, 128, device="cuda", dtype=torch.float16)
    got = run(q, k, v, ks, vs, table, lens, 1, "cuda", order=False)
    assert got.dtype == torch.float16
    assert rel(got, truth(q, k, v, ks, vs, table, lens)) < 1e-2


def test_strided_query_view():
    """The engine's q is a view of the fused qkv projection: rows strided past its own heads."""
    lens = [40, 90, 130]
    table, k, v, ks, vs = make_pool(lens, 8, 128, seed=3)
    qkv = torch.randn(len(lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, :16]
    got = run(q, k, v, ks, vs, table, lens, 2, "cuda")
    assert rel(got, truth(q.contiguous(), k, v, ks, vs, table, lens)) < 1e-2


def test_cuda_graph_replay_sees_new_lengths():
    """Captured once, replayed after the lengths grow in place: the launch reads them on the device
    (int64 lengths, as the engine's decode graphs keep them)."""
    from kvledger.engine.attention.triton_decode import DecodeWorkspace, decode_attention, longest_first

    lens = [100, 300, 33, 64]
    table, k, v, ks, vs = make_pool([n + 20 for n in lens], 8, 128, seed=11)
    q = torch.randn(len(lens), 16, 128, device="cuda", dtype=torch.bfloat16)
    seq = torch.tensor(lens, dtype=torch.int64, device="cuda")
    ws = DecodeWorkspace(len(lens), 16, 128, 16, "cuda")
    rows = torch.arange(len(lens), device="cuda")
    order = longest_first(seq)
    out = torch.empty_like(q)

    def step():
        decode_attention(
            q, k, v, 1, table, rows, seq, ws, 2, out=out, k_scale=ks, v_scale=vs, order=order, stage1="cuda"
        )

    step()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    grown = [n + 20 for n in lens]
    seq.copy_(torch.tensor(grown, dtype=torch.int64))
    order.copy_(longest_first(seq))
    graph.replay()
    torch.cuda.synchronize()
    assert rel(out, truth(q, k, v, ks, vs, table, grown)) < 1e-2


def test_rejects_what_it_does_not_handle():
    from kvledger.engine.attention.triton_decode import DecodeWorkspace, decode_attention

    lens = [10]
    table, k, v, ks, vs = make_pool(lens, 8, 128, seed=1)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ws = DecodeWorkspace(1, 16, 128, 16, "cuda")
    rows = torch.arange(1, device="cuda")
    q = torch.randn(1, 16, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA decode kernel"):
        decode_attention(q, k.to(torch.bfloat16), v.to(torch.bfloat16), 1, table, rows, seq, ws, 1, stage1="cuda")
    with pytest.raises(ValueError, match="stage1"):
        decode_attention(q, k, v, 1, table, rows, seq, ws, 1, stage1="cutlass")
    q8 = torch.randn(1, 40, 128, device="cuda", dtype=torch.bfloat16)  # 5 query heads per KV head
    with pytest.raises(ValueError, match="CUDA decode kernel"):
        decode_attention(q8, k, v, 1, table, rows, seq, ws, 1, stage1="cuda")


@pytest.mark.parametrize("splits", [1, 4])
def test_shared_prefixes_cascade(splits):
    """Cascade attention: the Triton prefix kernel reads each group's shared prefix once and the
    CUDA stage 1 only each row's own keys from START[b]; rows in no group mark their prefix slots
    empty (stale NaN there must never be read)."""
    from kvledger.engine.attention.shared_prefix import find_prefix_groups, members_per_group
    from kvledger.engine.attention.triton_decode import DecodeWorkspace, decode_attention, longest_first

    lens = [180, 150, 230, 70, 90, 40, 300, 5]
    shared = {0: 100, 1: 100, 2: 100, 3: 40, 4: 40}  # rows 0-2 share 100 locations, rows 3-4 share 40
    table, k, v, ks, vs = make_pool(lens, 8, 128, seed=5)
    table[1, :100] = table[0, :100]
    table[2, :100] = table[0, :100]
    table[4, :40] = table[3, :40]
    q = torch.randn(len(lens), 16, 128, device="cuda", dtype=torch.bfloat16)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    rows = torch.arange(len(lens), device="cuda")
    groups = find_prefix_groups(table, rows, seq, members_per_group(2))
    starts = groups.start.tolist()
    assert all(starts[r] > 0 for r in shared) and starts[5:] == [0, 0, 0]  # the groups were found
    ws = DecodeWorkspace(len(lens), 16, 128, 4, "cuda", prefix_splits=4)
    ws.part_o.fill_(float("nan"))
    ws.part_lse.fill_(float("nan"))
    got = decode_attention(
        q, k, v, 1, table, rows, seq, ws, splits, k_scale=ks, v_scale=vs, groups=groups,
        order=longest_first(seq), stage1="cuda",
    )  # fmt: skip
    want = truth(q, k, v, ks, vs, table, lens)
    assert not torch.isnan(got).any()
    for b in range(len(lens)):
        assert rel(got[b], want[b]) < 1e-2, (b, rel(got[b], want[b]))
