"""Cascade decode attention: a KV prefix shared by several running requests is read once per group.

With a radix cache, requests that matched the same cached prefix hold the same token locations
for it in their table rows. A plain decode kernel reads that prefix once per request; here the
batch is split, on the device and without a host sync (so a CUDA graph captures it), into groups
of rows whose table rows start with the same locations:

- `find_prefix_groups` keys each row by the location of its first token, caps a group at
  `max_members` rows (larger groups become several), and takes the longest run of locations
  every member shares with the group's first row: the group's prefix, `[0, prefix_len)`.
- The prefix kernel below runs one program per (group, KV head, split): the group's query rows
  (members x the KV head's query heads) attend over the prefix's keys, loaded once for all of
  them, and write partial outputs with their log-sum-exp into extra split slots of the decode
  workspace.
- The decode kernel (`triton_decode`) attends each row over its own suffix `[start, seq_len)`,
  and its merge combines suffix and prefix partials through the log-sum-exp: softmax over the
  union of two disjoint key sets, so the result equals attention over the whole context.

Rows outside any group get `start = 0` and the decode kernel marks their prefix slots empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl

    from kvledger.engine.attention.triton_online_softmax import attend_locations, finish_partial
except ImportError:
    triton = None

MAX_MEMBERS = 16  # rows per group: the prefix kernel's query tile is members x query heads per KV head
MIN_SHARED = 16  # shorter common prefixes are left to the plain decode kernel


@dataclass
class PrefixGroups:
    """start[b]: where row b's own part of its context begins (its group's prefix length, or 0).
    prefix_len[g]: > 0 only for the first row g of a group, the tokens its prefix program reads.
    members[g]: the group's batch rows (first row first), -1 padded.
    leaders: the first rows of the groups, -1 padded: the prefix kernel's programs."""

    start: torch.Tensor  # [B] int32
    prefix_len: torch.Tensor  # [B] int32
    members: torch.Tensor  # [B, max_members] int32
    leaders: torch.Tensor  # [max_groups] int32


def members_per_group(group: int) -> int:
    """Rows per group so that the prefix kernel's tile stays at most 64 query rows."""
    group_pad = 1 << (group - 1).bit_length()  # the next power of two, as the kernel pads it
    return max(1, min(MAX_MEMBERS, 64 // group_pad))


def max_groups_for(batch_size: int) -> int:
    """Prefix programs launched per KV head and split: a quarter of the batch (groups of four
    and more all fit). A batch without sharing still launches them, and they return at once."""
    return max(1, -(-batch_size // 4))


def find_prefix_groups(
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    max_members: int = MAX_MEMBERS,
    min_shared: int = MIN_SHARED,
    max_groups: int | None = None,
) -> PrefixGroups:
    """Group a decode batch by shared prefix locations, with fixed-shape tensor ops only.

    table: [table_rows, width] int32 token locations; rows: [B] table row of each batch row;
    seq_lens: [B] context length including the token being decoded. Only positions before
    seq_len - 1 count as shared (the newest token is each row's own), and a row with fewer
    than `min_shared` such positions (a CUDA graph's padding rows among them) joins no group.
    Groups past the first `max_groups` (default `max_groups_for(B)`) are left ungrouped.
    """
    b = rows.numel()
    device = rows.device
    idx = torch.arange(b, device=device)
    seq = seq_lens.long()
    first = table[rows, 0].long()
    eligible = seq - 1 >= min_shared
    key = torch.where(eligible, first, -1 - idx)  # ineligible rows get a key of their own
    same_key = key[:, None] == key[None, :]
    rank = (same_key & (idx[None, :] < idx[:, None])).sum(1)  # earlier rows with the same key
    part = rank // max_members
    same_group = same_key & (part[:, None] == part[None, :])
    leader = torch.where(same_group, idx[None, :], b).amin(1)
    slot = rank % max_members

    # how many leading locations each row shares with its leader, within both rows' old tokens
    limit = torch.minimum(seq, seq[leader]) - 1
    width = table.shape[1]
    cols = torch.arange(width, device=device)
    mine = table[rows]
    theirs = table[rows[leader]]
    differs = (mine != theirs) | (cols[None, :] >= limit[:, None])
    differs = torch.cat([differs, torch.ones(b, 1, dtype=torch.bool, device=device)], 1)
    common = differs.int().argmax(1)  # the first differing column: the shared run's length

    size = torch.zeros(b, dtype=torch.long, device=device).scatter_add_(0, leader, torch.ones_like(leader))
    shared = torch.full((b,), width + 1, dtype=torch.long, device=device).scatter_reduce_(
        0, leader, common, reduce="amin", include_self=True
    )
    is_leader = (size >= 2) & (shared >= min_shared) & eligible
    max_groups = max_groups_for(b) if max_groups is None else max_groups
    order = is_leader.long().cumsum(0) - 1
    is_leader &= order < max_groups
    shared = torch.where(is_leader, shared, 0)
    members = torch.full((b, max_members), -1, dtype=torch.int32, device=device)
    members.index_put_((leader, slot), idx.to(torch.int32))
    # the leaders in batch order; rows that lead nothing all land in a discarded last slot
    leaders = torch.full((max_groups + 1,), -1, dtype=torch.int32, device=device)
    leaders.scatter_(0, torch.where(is_leader, order, max_groups), idx.to(torch.int32))
    return PrefixGroups(
        start=shared[leader].to(torch.int32),
        prefix_len=shared.to(torch.int32),
        members=members,
        leaders=leaders[:max_groups],
    )


if triton is not None:

    @triton.jit
    def _shared_prefix_attention_kernel(
        Q,
        K,
        V,
        TABLE,
        ROWS,
        LEADERS,
        PREFIX_LEN,
        MEMBERS,
        PART_O,
        PART_LSE,
        stride_qb,
        stride_qh,
        stride_kn,
        stride_kh,
        stride_tr,
        stride_mg,
        stride_pb,
        stride_ph,
        stride_ps,
        stride_lb,
        stride_lh,
        sm_scale,
        v_scale,
        PRECISION: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        MEMBERS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        FIRST_SLOT: tl.constexpr,
        PREFIX_SPLITS: tl.constexpr,
        DOT: tl.constexpr,
    ):
        g = tl.load(LEADERS + tl.program_id(0))
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        if g < 0:  # fewer groups than programs
            return
        prefix_len = tl.load(PREFIX_LEN + g)
        row = tl.load(ROWS + g).to(tl.int64)
        per_split = tl.cdiv(tl.cdiv(prefix_len, PREFIX_SPLITS), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, prefix_len)

        # query rows: member m's query head kv_head * GROUP + h at tile row m * GROUP_PAD + h
        offs_r = tl.arange(0, MEMBERS_PAD * GROUP_PAD)
        h = offs_r % GROUP_PAD
        member = tl.load(MEMBERS + g * stride_mg + offs_r // GROUP_PAD).to(tl.int64)
        r_mask = (member >= 0) & (h < GROUP)
        member = tl.where(r_mask, member, 0)
        heads = kv_head * GROUP + h
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(
            Q + member[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=r_mask[:, None],
            other=0.0,
        ).to(DOT)

        m_i, l_i, acc = attend_locations(
            q,
            K,
            V,
            TABLE + row * stride_tr,
            start,
            end,
            kv_head * stride_kh,
            stride_kn,
            sm_scale,
            MEMBERS_PAD * GROUP_PAD,
            HEAD_DIM,
            BLOCK_N,
            PRECISION,
            DOT,
        )
        out, lse = finish_partial(m_i, l_i, acc, v_scale)  # a split past a short prefix's end is empty
        slot = FIRST_SLOT + split
        base = member * stride_pb + heads * stride_ph + slot * stride_ps
        tl.store(PART_O + base[:, None] + offs_d[None, :], out, mask=r_mask[:, None])
        tl.store(PART_LSE + member * stride_lb + heads * stride_lh + slot, lse, mask=r_mask)


def shared_prefix_partials(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    token_dim: int,
    table: torch.Tensor,
    rows: torch.Tensor,
    groups: PrefixGroups,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    first_slot: int,
    prefix_splits: int,
    sm_scale: float,
    v_scale: float,
    dot,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> None:
    """Write each grouped row's prefix partials into slots [first_slot, first_slot + prefix_splits)."""
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1 - token_dim]
    group = heads // kv_heads
    members = groups.members
    _shared_prefix_attention_kernel[(groups.leaders.numel(), kv_heads, prefix_splits)](
        q,
        k_cache,
        v_cache,
        table,
        rows,
        groups.leaders,
        groups.prefix_len,
        members,
        part_o,
        part_lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(token_dim),
        k_cache.stride(1 - token_dim),
        table.stride(0),
        members.stride(0),
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        sm_scale,
        v_scale,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        MEMBERS_PAD=triton.next_power_of_2(members.shape[1]),
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        FIRST_SLOT=first_slot,
        PREFIX_SPLITS=prefix_splits,
        DOT=dot,
        num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
