"""The judge's clauses for several KV groups (properties/group_judge.py, properties/subject_judge.py).

The views are shaped like vLLM's hybrid coordinator on this box (notes/field-paths.md section 3):
full attention plus a sliding window of 8 tokens, block size 4, a 20-token prompt prefilled in
chunks of 8, 8 and 4. After the first chunk the tables are FA [1, 2], SWA [3, 4]; after the third
FA [1, 2, 5, 6, 9], SWA [null, null, 7, 8, 10] (the null block is None in the view). Dropped SWA
blocks 3 and 4 keep their hash in the free queue, as vLLM's do. Each test breaks one thing in that
sound state and checks the judge names the invariant and the group."""

from __future__ import annotations

from dataclasses import replace
from typing import Hashable, List, Sequence

import pytest

from kvledger.engine.ledger.invariants import InvariantViolation
from kvledger.properties.subject import CachedEntry, Capabilities, GroupView, View
from kvledger.properties.subject_judge import Witness, judge

BS = 4
WINDOW = 8
PROMPT = list(range(30, 50))  # 20 tokens
HYBRID = Capabilities(
    page_size=BS,
    pages=tuple(range(1, 13)),  # block 0 is vLLM's null block, outside the pool
    worst_case_admission=False,
    preempts=True,
    explicit_evict=False,
    cached_pages_in_free_pool=True,
)


class Keys:
    """A hash-chained cache's key per group, as vLLM's BlockHashWithGroupId."""

    def cache_key(self, tokens: Sequence[int], group: int = 0) -> Hashable:
        return (group, tuple(tokens))


class OneGroupKeys:
    """A subject of one group keeps the one-argument `cache_key` (every subject written before groups)."""

    def cache_key(self, tokens: Sequence[int]) -> Hashable:
        return tuple(tokens)


def row(blocks: Sequence[int | None], n: int) -> List[int | None]:
    """Positions [0, n) of a block table: block b holds position p at b * BS + p % BS; None: null."""
    return [None if blocks[p // BS] is None else blocks[p // BS] * BS + p % BS for p in range(n)]  # type: ignore[operator]


def entry(block: int, index: int, group: int = 0, tokens: Sequence[int] = PROMPT) -> CachedEntry:
    """Block `block` filed, as vLLM does, under the key of the prefix through its block `index`."""
    return CachedEntry(
        tuple(range(block * BS, block * BS + BS)),
        start=None,
        key=Keys().cache_key(tokens[: (index + 1) * BS], group),
        name=f"block {block}",
        group=group,
    )


def sound():
    """uid 1 after its third chunk: 20 positions computed, the window group reads [13, 20)."""
    witness = Witness()
    witness.tokens[1] = PROMPT + [7]
    witness.prompt_len[1] = len(PROMPT)
    first = View(free=[], requests={1: row([1, 2], 8)}, groups=[GroupView("swa", WINDOW, {1: row([3, 4], 8)})])
    witness.wrote_view(first, 1, witness.tokens[1], 0, 8)
    view = View(
        free=[3, 4, 11, 12],
        requests={1: row([1, 2, 5, 6, 9], 20)},
        cached=[entry(b, i) for i, b in enumerate([1, 2, 5, 6, 9])]
        + [entry(3, 0, 1), entry(4, 1, 1)]
        + [entry(b, i, 1) for i, b in ((2, 7), (3, 8), (4, 10))],
        page_refs={p: 0 if p in (3, 4, 11, 12) else 1 for p in range(1, 13)},
        groups=[GroupView("swa", WINDOW, {1: row([None, None, 7, 8, 10], 20)})],
    )
    witness.wrote_view(view, 1, witness.tokens[1], 8, 20)
    witness.computed[1] = 20
    return view, witness


def verdict(view, witness, caps=HYBRID, subject=None):
    try:
        judge(view, caps, witness, subject or Keys())
    except InvariantViolation as e:
        return e.invariant, str(e)
    return None


def test_the_hybrid_state_vllm_reaches_passes():
    view, witness = sound()
    assert verdict(view, witness) is None
    # the window still reads [13, 20): dropping block 7 (positions 8-11) too is sound
    view.groups[0].requests[1] = row([None, None, None, 8, 10], 20)
    view.free.append(7)
    view.page_refs[7] = 0
    assert verdict(view, witness) is None


def test_wrote_view_writes_every_groups_row_and_skips_null_positions():
    view, witness = sound()
    for loc in [1 * BS, 9 * BS + 3, 3 * BS, 7 * BS, 10 * BS + 3]:
        assert loc in witness.written
    assert witness.written[10 * BS + 3] == witness.written[9 * BS + 3]  # both groups hold position 19's KV
    fresh = Witness()
    fresh.wrote_view(view, 1, witness.tokens[1], 0, 20)
    assert 3 * BS not in fresh.written  # null positions 0-7 of the window group: nothing written


def _drop_block_8_in_window(v, w):
    v.groups[0].requests[1] = row([None, None, 7, None, 10], 20)
    v.free.append(8)
    v.page_refs[8] = 0


def _block_in_two_groups(v, w):
    v.groups[0].requests[1] = row([None, None, 7, 8, 9], 20)
    v.free.append(10)
    v.page_refs[10] = 0
    v.cached = [e for e in v.cached if e.name != "block 10"]


@pytest.mark.parametrize(
    "change, invariant, words",
    [
        (_drop_block_8_in_window, "7-kv-provenance", "uid 1, group 1 (swa, window 8): position 13 has no location"),
        (_block_in_two_groups, "1-2-partition", "page 9 is in rows of two KV groups"),
        (lambda v, w: v.page_refs.__setitem__(7, 2), "1-2-partition", "page 7 has reference count 2, but 1 live"),
        (lambda v, w: v.page_refs.__setitem__(9, 0), "1-2-partition", "page 9 has reference count 0, but 1 live"),
        (lambda v, w: v.groups[0].requests.pop(1), "8-request", "group 1 (swa, window 8): live uids [1] have no row"),
        (
            lambda v, w: v.groups[0].requests.__setitem__(2, row([11], 4)),
            "8-request",
            "rows for uids [2], which are not live",
        ),
        (
            lambda v, w: v.groups[0].requests[1].__setitem__(9, 8 * BS + 1),
            "1-2-partition",
            "uid 1 (group 1 (swa, window 8)): position 9 is at location 33, not offset 1 of the page that holds "
            "position 8 (location 28)",
        ),
        (
            lambda v, w: v.groups[0].requests[1].__setitem__(17, 11 * BS + 1),
            "1-2-partition",
            "position 17 is at location 45, not offset 1 of the page that holds position 16",
        ),
        (
            lambda v, w: w.written.__setitem__(10 * BS + 1, w.written[9 * BS]),
            "7-kv-provenance",
            "uid 1, group 1 (swa, window 8): position 17 reads location 41, which holds KV computed for other tokens",
        ),
        (lambda v, w: w.written.pop(8 * BS + 3), "7-kv-provenance", "position 15 reads location 35, which was never"),
        (
            lambda v, w: v.cached.append(replace(entry(9, 4, 1), name="swa block 9")),
            "1-2-partition",
            "cache swa block 9 of group 1 (swa, window 8) holds page 9, which live uid(s) [1] hold in group 0",
        ),
        (
            lambda v, w: v.cached.__setitem__(-1, replace(v.cached[-1], key=Keys().cache_key(PROMPT[:20], 0))),
            "7-kv-provenance",
            "cache block 10 is filed under key",
        ),
        (
            lambda v, w: v.cached.__setitem__(-1, replace(v.cached[-1], group=2)),
            "1-2-partition",
            "cache block 10 belongs to KV group 2, but the view has 2 group(s)",
        ),
    ],
)
def test_each_group_clause_names_what_broke(change, invariant, words):
    view, witness = sound()
    change(view, witness)
    found = verdict(view, witness)
    assert found is not None and found[0] == invariant and words in found[1], found


def test_positions_before_the_window_may_be_dropped_but_a_full_attention_group_holds_all():
    view, witness = sound()
    full = GroupView("full-2", None, {1: row([11, 12, None, None, None], 20)})
    view.groups.append(full)
    view.free = [3, 4]
    view.page_refs.update({11: 1, 12: 1})
    found = verdict(view, witness)
    assert found[0] == "7-kv-provenance" and "uid 1, group 2 (full-2): position 0 reads location 44" in found[1]
    witness.wrote_view(view, 1, witness.tokens[1], 0, 8)
    found = verdict(view, witness)
    assert found[0] == "7-kv-provenance" and "group 2 (full-2): position 8 has no location (dropped)" in found[1]


def test_a_second_request_hits_per_group_and_shares_blocks_at_the_same_positions():
    """vLLM: a request sharing 16 tokens hits FA [1, 2, 5, 6] and SWA [null, null, 7, 8]."""
    view, witness = sound()
    tokens = PROMPT[:16] + [90, 91, 92]
    witness.tokens[2], witness.prompt_len[2], witness.computed[2] = tokens, len(tokens), 16
    view.requests[2] = row([1, 2, 5, 6, 11], 19)
    view.groups[0].requests[2] = row([None, None, 7, 8, 12], 19)
    view.free = [3, 4]
    view.page_refs.update({1: 2, 2: 2, 5: 2, 6: 2, 7: 2, 8: 2, 11: 1, 12: 1})
    assert verdict(view, witness) is None
    view.page_refs[8] = 1
    assert "page 8 has reference count 1, but 2 live request(s) [1, 2]" in verdict(view, witness)[1]
    view.page_refs[8] = 2
    view.groups[0].requests[2] = row([None, 7, None, 8, 12], 19)  # block 7 at positions 4-7
    found = verdict(view, witness)
    assert found[0] == "1-2-partition" and "page 7 is held by uids [1, 2] at different positions [4, 8]" in found[1]


def test_group_zero_keeps_the_one_argument_cache_key():
    view, witness = sound()
    view.groups, view.free = [], [3, 4, 7, 8, 10, 11, 12]
    view.cached = [
        replace(e, key=OneGroupKeys().cache_key(PROMPT[: (i + 1) * BS])) for i, e in enumerate(view.cached[:5])
    ]
    view.page_refs = {p: 1 if p in (1, 2, 5, 6, 9) else 0 for p in range(1, 13)}
    assert verdict(view, witness, subject=OneGroupKeys()) is None


def test_an_exhausted_pool_counts_the_pages_a_window_group_holds():
    """The rare event "a decode needs a page on a pool with no free or evictable page": a cached
    block held by a request's window-group row is not evictable (vLLM:hybrid reached the state
    only once the rows of every group counted)."""
    from kvledger.properties.subject_events import pool_exhausted

    window = GroupView("swa", WINDOW, {0: [None, None, 7 * BS, 8 * BS]})
    held = View(
        free=[],
        requests={0: [1 * BS, 2 * BS, 5 * BS, 6 * BS]},
        cached=[CachedEntry((1 * BS,), 0), CachedEntry((7 * BS,), 8, group=1)],
        groups=[window],
    )
    assert pool_exhausted(held, BS)
    window.requests[0][3] = None  # block 8 no longer held: the cached block 7 still is
    assert pool_exhausted(held, BS)
    window.requests[0][2] = None  # block 7 dropped from the window: cached and evictable now
    assert not pool_exhausted(held, BS)
