"""Cascade decode attention: the grouping of a decode batch by shared prefix locations (plain
torch, runs everywhere) and the prefix + suffix kernels against the gathered-KV oracle (on the
GPU, or under Triton's CPU interpreter when Triton is installed (tests/conftest.py sets
TRITON_INTERPRET); skipped otherwise)."""

import pytest
import torch

from kvledger.engine.attention.shared_prefix import find_prefix_groups  # noqa: E402
from tests.support.models import tiny_qwen3  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _shared_table(prefix_pages, own_pages, page_size, seed, extra_rows=1):
    """A table whose rows (after `extra_rows` unused ones) start with their group's pages.

    prefix_pages[i]: (group id, pages of the group's prefix this row holds); rows of one group
    hold the same leading pages. own_pages[i]: pages of its own after them."""
    g = torch.Generator().manual_seed(seed)
    group_pages = {}
    rows = []
    n_pages = sum(o for o in own_pages) + sum(p for _, p in prefix_pages) + 4
    perm = torch.randperm(n_pages, generator=g).tolist()
    for (gid, p), own in zip(prefix_pages, own_pages):
        if gid not in group_pages:
            group_pages[gid] = [perm.pop() for _ in range(max(q for k, q in prefix_pages if k == gid))]
        shared = group_pages[gid]
        rows.append(shared[:p] + [perm.pop() for _ in range(own)])
    width = max(len(r) for r in rows) * page_size
    table = torch.zeros(len(rows) + extra_rows, width, dtype=torch.int32)
    for i, pages in enumerate(rows):
        locs = (torch.tensor(pages)[:, None] * page_size + torch.arange(page_size)).flatten()
        table[i + extra_rows, : len(locs)] = locs
    return table, n_pages


def test_groups_rows_that_share_leading_locations():
    page = 4
    # rows 0, 2, 3 share group A's 8 pages (row 3 only 5 of them); row 1 is alone; rows 4, 5 share B
    spec = [("A", 8), ("L", 6), ("A", 8), ("A", 5), ("B", 6), ("B", 6)]
    own = [2, 1, 3, 2, 1, 4]
    table, _ = _shared_table(spec, own, page, seed=0)
    rows = torch.arange(1, 7)
    seq = torch.tensor([(p + o) * page - 1 for (_, p), o in zip(spec, own)], dtype=torch.int32)
    groups = find_prefix_groups(table, rows, seq, max_members=16, min_shared=4)
    # group A is led by row 0 and shares what all three hold: 5 pages
    assert groups.prefix_len.tolist() == [5 * page, 0, 0, 0, 6 * page, 0]
    assert groups.start.tolist() == [5 * page, 0, 5 * page, 5 * page, 6 * page, 6 * page]
    assert groups.members[0].tolist()[:3] == [0, 2, 3] and (groups.members[0, 3:] == -1).all()
    assert groups.members[4].tolist()[:2] == [4, 5]
    assert (groups.members[[2, 3, 5]] == -1).all()  # they lead no group
    assert groups.members[1].tolist()[:2] == [1, -1]  # a group of one: no prefix program
    assert groups.leaders.tolist() == [0, 4]  # max_groups_for(6) = 2
    # one program per batch allowed: group B is left to the plain decode kernel
    one = find_prefix_groups(table, rows, seq, max_members=16, min_shared=4, max_groups=1)
    assert one.leaders.tolist() == [0] and one.prefix_len.tolist() == [5 * page, 0, 0, 0, 0, 0]
    assert one.start.tolist() == [5 * page, 0, 5 * page, 5 * page, 0, 0]


def test_shared_part_stops_before_each_rows_newest_token():
    """A row whose whole context is the shared prefix keeps its newest token (and the group's
    prefix shrinks to what every member has before its newest token)."""
    page = 4
    table, _ = _shared_table([("A", 6), ("A", 6)], [0, 2], page, seed=1)
    rows = torch.tensor([1, 2])
    seq = torch.tensor([6 * page, 8 * page], dtype=torch.int32)  # row 0 decodes its prefix's last token
    groups = find_prefix_groups(table, rows, seq, min_shared=4)
    assert groups.prefix_len.tolist() == [6 * page - 1, 0]
    assert groups.start.tolist() == [6 * page - 1, 6 * page - 1]


def test_groups_larger_than_the_tile_are_split_and_short_rows_join_none():
    page = 2
    spec = [("A", 10)] * 7 + [("A", 10)]
    own = [1] * 8
    table, _ = _shared_table(spec, own, page, seed=2)
    rows = torch.arange(1, 9)
    seq = torch.full((8,), 11 * page, dtype=torch.int32)
    seq[7] = 3  # too short to share anything worth a group
    groups = find_prefix_groups(table, rows, seq, max_members=3, min_shared=4)
    # seven eligible rows: groups of 3, 3 and 1 (a group of one shares nothing)
    assert groups.prefix_len.tolist() == [20, 0, 0, 20, 0, 0, 0, 0]
    assert groups.members[0].tolist() == [0, 1, 2] and groups.members[3].tolist() == [3, 4, 5]
    assert groups.start.tolist() == [20] * 6 + [0, 0]


def test_padding_rows_of_a_graph_join_no_group():
    """Captured graphs pad the batch with rows that read table row 0 at length 1."""
    page = 4
    table, _ = _shared_table([("A", 4), ("A", 4)], [1, 1], page, seed=3, extra_rows=0)
    rows = torch.tensor([0, 1, 0, 0])
    seq = torch.tensor([5 * page, 5 * page, 1, 1], dtype=torch.int32)
    groups = find_prefix_groups(table, rows, seq, min_shared=4)
    assert groups.prefix_len.tolist() == [4 * page, 0, 0, 0]
    assert groups.start.tolist() == [4 * page, 4 * page, 0, 0]
    assert groups.members[0].tolist()[:3] == [0, 1, -1]


def test_rows_with_equal_first_location_but_different_pages_share_only_the_common_run():
    page = 4
    table, _ = _shared_table([("A", 3), ("A", 3)], [5, 5], page, seed=4)
    rows = torch.tensor([1, 2])
    seq = torch.tensor([8 * page, 8 * page], dtype=torch.int32)
    groups = find_prefix_groups(table, rows, seq, min_shared=4)
    assert groups.prefix_len.tolist() == [3 * page, 0]
    # a row whose table entry past the shared run happens to match is still cut at the first difference
    table[2, 3 * page] = table[1, 3 * page]
    table[2, 3 * page + 1] = table[1, 3 * page + 1] + 1
    groups = find_prefix_groups(table, rows, seq, min_shared=4)
    assert groups.prefix_len.tolist() == [3 * page + 1, 0]


def _oracle(k_pool, v_pool, q, table, rows, seq, heads, kv_heads):
    outs = []
    for i in range(q.shape[0]):
        locs = table[rows[i], : seq[i]].long()
        k = k_pool[locs].float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        v = v_pool[locs].float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        outs.append(torch.nn.functional.scaled_dot_product_attention(q[i].float()[:, None], k, v)[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("seed", range(3))
def test_cascade_decode_matches_gathered_sdpa(seed):
    """Rows in groups of several sizes, singletons and rows shorter than min_shared, every split
    count: the cascade result equals attention over each row's whole context."""
    pytest.importorskip("triton")
    from kvledger.engine.attention.shared_prefix import members_per_group
    from kvledger.engine.attention.triton_decode import DecodeWorkspace, decode_attention

    dtype = torch.float32 if DEVICE == "cpu" else [torch.float32, torch.bfloat16, torch.bfloat16][seed]
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    heads, kv_heads, head_dim = [(4, 2, 32), (9, 3, 64), (16, 8, 128)][seed]
    page = [1, 4, 16][seed]
    g = torch.Generator().manual_seed(seed)
    spec = [
        ("A", 40 // page),
        ("B", 20 // page + 1),
        ("A", 40 // page),
        ("C", 3),
        ("A", 30 // page),
        ("B", 20 // page + 1),
        ("D", 0),
        ("A", 40 // page),
    ]
    own = [int(torch.randint(1, 70 // page + 2, (1,), generator=g)) for _ in spec]
    table, n_pages = _shared_table(spec, own, page, seed=seed)
    rows = torch.arange(1, len(spec) + 1)
    seq = torch.tensor(
        [(p + o) * page - int(torch.randint(0, page, (1,), generator=g)) for (_, p), o in zip(spec, own)],
        dtype=torch.int32,
    )
    k_pool = torch.randn(n_pages * page, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    v_pool = torch.randn(n_pages * page, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    q = torch.randn(len(spec), heads, head_dim, generator=g).to(DEVICE, dtype)
    table, rows, seq = table.to(DEVICE), rows.to(DEVICE), seq.to(DEVICE)
    expected = _oracle(k_pool, v_pool, q, table, rows, seq, heads, kv_heads)
    groups = find_prefix_groups(table, rows, seq, members_per_group(heads // kv_heads))
    assert int(groups.prefix_len.count_nonzero()) >= 2  # groups A and B do share
    one_group = find_prefix_groups(table, rows, seq, members_per_group(heads // kv_heads), max_groups=1)
    for prefix_splits, found in ((1, groups), (4, groups), (4, one_group)):
        ws = DecodeWorkspace(8, heads, head_dim, 4, DEVICE, prefix_splits=prefix_splits)
        ws.part_o.fill_(float("nan"))  # stale values in unused slots must never be read
        ws.part_lse.fill_(float("nan"))
        for splits in (1, 4):
            out = decode_attention(q, k_pool, v_pool, 0, table, rows, seq, ws, splits, groups=found)
            assert not torch.isnan(out).any()
            err = (out.float() - expected).norm() / expected.norm()
            assert err < tol, f"{splits} splits, {prefix_splits} prefix splits: relative error {err:.2e}"


def _prefix_prompts(groups, n, seed=0):
    import random

    from kvledger.fast import SamplingParams

    rng = random.Random(seed)
    prefixes = [[rng.randrange(1024) for _ in range(rng.choice([64, 200, 333]))] for _ in range(groups)]
    prompts = [prefixes[i % groups] + [rng.randrange(1024) for _ in range(rng.randint(1, 40))] for i in range(n)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(10, 50)) for _ in prompts]
    return prompts, params


def test_the_scheduler_knows_when_running_requests_may_share_pages():
    """Decode takes the plain (graph) path unless a live request came with a cached prefix: on
    while prefix hits run, off once they end, never on for prompts with nothing in common."""
    from kvledger.engine.runtime.llm import LLM

    seen = []
    llm = LLM(
        tiny_qwen3(), dummy_weights=True, page_size=4, kv_cache_tokens=4096, max_running_req=8, max_prefill_tokens=256
    )
    llm.engine.observers.append(lambda step, op, state: seen.append(llm.engine.sharing_possible))
    prompts, params = _prefix_prompts(2, 8)
    llm.generate(prompts, params)
    assert any(seen) and not llm.engine.sharing_possible
    seen.clear()
    unrelated, params = _prefix_prompts(6, 6, seed=1)  # six different prefixes, one request each
    unrelated = [[7 + i] + p for i, p in enumerate(unrelated)]  # and nothing in the cache from before
    llm.generate(unrelated, params)
    assert seen and not any(seen)
    # each request again, so each hits its own cached prompt (a chat's next turn): nothing shared
    seen.clear()
    assert [o.cached_tokens >= 16 for o in llm.generate(unrelated, params)] == [True] * 6
    assert seen and not any(seen)


def test_prefix_sharing_needs_a_hit_and_a_second_request_with_the_same_start():
    from kvledger.engine.runtime.prefix_sharing import PrefixSharing

    s = PrefixSharing(min_shared=4)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9]  # the same first four tokens
    s.admitted(1, a, hit=0)
    s.admitted(2, [7, 7, 7, 7, 7], hit=5)  # a hit on a prompt nobody else runs
    assert not s.possible
    s.admitted(3, b, hit=3)  # the same start, but a hit too short to share a group's worth
    assert not s.possible
    s.admitted(4, b, hit=4)
    assert s.possible
    s.forget(1)
    assert s.possible  # 3 and 4 still share their start
    s.forget(3)
    assert not s.possible  # 4 is alone with its start now
    s.admitted(4, b, hit=0)  # re-admitted after a preemption: counted once, its earlier hit kept
    s.admitted(5, [1, 2, 3, 0, 4], hit=0)  # equal up to the third token only
    assert not s.possible
    s.admitted(6, b, hit=0)
    assert s.possible
    for uid in (2, 4, 5, 6):
        s.forget(uid)
    assert not s.possible and not s._count and not s._key


@pytest.mark.cuda
def test_engine_with_cascade_attention_gives_the_tokens_of_flat_decode(monkeypatch):
    """Groups of prompts behind a shared prefix, float32: cascade decode (eager, then CUDA graphs
    with overlap) generates exactly the greedy tokens of flat decode, and the eager run did group."""
    from kvledger.engine.attention import triton_paged
    from kvledger.engine.runtime.llm import LLM

    config = tiny_qwen3()
    prompts, params = _prefix_prompts(4, 28)
    kw = dict(
        dummy_weights=True,
        device="cuda",
        dtype="float32",
        page_size=16,
        kv_cache_tokens=20000,
        max_running_req=32,
        max_seq_len=512,
        max_prefill_tokens=256,
    )
    flat = LLM(config, cuda_graphs=False, overlap=False, cascade_attention=False, **kw)
    expected = [o.token_ids for o in flat.generate(prompts, params)]
    flat.close()

    grouped_rows = []
    find = triton_paged.find_prefix_groups

    def spy(*args, **kwargs):
        groups = find(*args, **kwargs)
        grouped_rows.append(int((groups.start > 0).sum()))
        return groups

    monkeypatch.setattr(triton_paged, "find_prefix_groups", spy)
    eager = LLM(config, cuda_graphs=False, overlap=False, **kw)
    assert eager.model.attn_backend.cascade
    assert [o.token_ids for o in eager.generate(prompts, params)] == expected
    eager.close()
    monkeypatch.undo()  # the spy syncs: no graph could capture it
    assert max(grouped_rows) >= 8, grouped_rows
    graphs = LLM(config, cuda_graphs=True, overlap=True, **kw)
    assert graphs.engine.graphs is not None and graphs.engine.graphs.variants == (False, True)
    assert [o.token_ids for o in graphs.generate(prompts, params)] == expected
    graphs.close()
