"""The judge's over-allocation clause (11-over-allocation) and what it never reads as valid.

A request may hold locations past its known tokens (vLLM's lookahead slots and draft positions,
an overlap scheduler's reserve) up to round_up(len(tokens) + max_ahead, page_size); positions past
`computed` are owned but never read as valid, so a rejected draft's KV there is harmless until a
cache entry claims it. The states follow vLLM's speculative decoding on this box
(notes/field-paths.md section 1): block size 4, a prompt, drafts verified, some rejected, the
block table never shrunk by a rejection."""

from __future__ import annotations

from dataclasses import replace
from typing import Hashable, Sequence

import pytest

from kvledger.engine.ledger.invariants import InvariantViolation
from kvledger.properties.subject import CachedEntry, Capabilities, GroupView, View
from kvledger.properties.subject_judge import Witness, judge

BS = 4
PLAIN = Capabilities(
    page_size=BS,
    pages=tuple(range(1, 9)),
    worst_case_admission=False,
    preempts=True,
    explicit_evict=False,
    cached_pages_in_free_pool=True,
)
SPEC = replace(PLAIN, spec_tokens=3, max_ahead=3)  # EAGLE-style: 3 lookahead slots


class Keys:
    def cache_key(self, tokens: Sequence[int], group: int = 0) -> Hashable:
        return (group, tuple(tokens))


def slots(blocks: Sequence[int], n: int) -> list[int]:
    return [blocks[p // BS] * BS + p % BS for p in range(n)]


def verdict(view: View, witness: Witness, caps: Capabilities):
    try:
        judge(view, caps, witness, Keys())
    except InvariantViolation as e:
        return e.invariant, str(e)
    return None


def prefilled(caps: Capabilities, blocks: Sequence[int], n: int):
    """uid 1: a 5-token prompt computed, one token sampled; its row holds `n` positions of `blocks`."""
    witness = Witness()
    witness.tokens[1] = [30, 31, 32, 33, 34, 35]
    witness.prompt_len[1] = 5
    view = View(free=[b for b in caps.pages if b not in blocks], requests={1: slots(blocks, n)})
    witness.wrote_view(view, 1, witness.tokens[1], 0, 5)
    witness.computed[1] = 5
    view.page_refs = {p: int(p in blocks) for p in caps.pages}
    return view, witness


def test_a_row_within_its_tokens_page_passes_and_one_page_more_is_over_allocation():
    view, witness = prefilled(PLAIN, [1, 2], 8)  # 6 tokens: up to position 8
    assert verdict(view, witness, PLAIN) is None
    view, witness = prefilled(PLAIN, [1, 2, 3], 9)
    found = verdict(view, witness, PLAIN)
    assert found == (
        "11-over-allocation",
        "[11-over-allocation] uid 1 holds locations for 9 positions in group 0, but it has 6 tokens and may "
        "hold at most 8 (max_ahead 0, rounded up to whole pages)",
    ), found


@pytest.mark.parametrize("n, ok", [(9, True), (12, True), (13, False)])
def test_max_ahead_allows_lookahead_slots_up_to_the_page_bound(n, ok):
    """6 tokens + 3 lookahead slots: round_up(9, 4) = 12 positions."""
    view, witness = prefilled(SPEC, [1, 2, 3, 4][: -(-n // BS)], n)
    found = verdict(view, witness, SPEC)
    assert (found is None) == ok, found
    if not ok:
        assert found[0] == "11-over-allocation" and "may hold at most 12 (max_ahead 3" in found[1]


def test_every_groups_row_is_bounded():
    view, witness = prefilled(SPEC, [1, 2], 8)
    view.groups = [GroupView("swa", 8, {1: slots([3, 4, 5, 6], 16)})]
    view.free = [7, 8]
    view.page_refs.update({3: 1, 4: 1, 5: 1, 6: 1})
    witness.wrote_view(view, 1, witness.tokens[1], 0, 5)
    found = verdict(view, witness, SPEC)
    assert found[0] == "11-over-allocation" and "16 positions in group 1 (swa, window 8)" in found[1], found
    view.groups[0].requests[1] = slots([3, 4, 5], 12)
    view.free = [6, 7, 8]
    view.page_refs[6] = 0
    assert verdict(view, witness, SPEC) is None


def spec_step(accepted: int):
    """A decode step verifies drafts [20, 21, 22] after token 34 at position 4, accepts `accepted`
    of them and samples a bonus token; the block table (blocks 1, 2, 3: lookahead) is kept."""
    witness = Witness()
    prompt = [30, 31, 32, 33, 34]
    witness.tokens[1], witness.prompt_len[1] = list(prompt), 5
    view = View(free=[4, 5, 6, 7, 8], requests={1: slots([1, 2, 3], 12)})
    witness.wrote_view(view, 1, prompt, 0, 4)
    witness.wrote_view(view, 1, prompt + [20, 21, 22], 4, 8)  # the model wrote the drafts' KV too
    witness.tokens[1] += [20, 21, 22][:accepted] + [40]
    witness.computed[1] = 5 + accepted
    view.cached = [CachedEntry(tuple(range(4, 8)), start=None, key=Keys().cache_key(prompt[:4]), name="block 1")]
    view.page_refs = {p: int(p in (1, 2, 3)) for p in PLAIN.pages}
    return view, witness


def test_positions_past_computed_are_not_read_as_valid():
    """Two drafts accepted: position 7 holds the rejected draft 22's KV, past `computed` (7)."""
    view, witness = spec_step(2)
    assert witness.tokens[1][7] == 40 and verdict(view, witness, SPEC) is None


def test_a_cached_block_holding_a_rejected_drafts_kv_fails_provenance():
    """vLLM files blocks only up to num_computed_tokens after the rollback; a subject that files
    block 2 (positions 4-7) under the accepted tokens' key caches the KV of draft 22 at position 7."""
    view, witness = spec_step(2)
    accepted = witness.tokens[1][:8]
    view.cached.append(CachedEntry(tuple(range(8, 12)), start=None, key=Keys().cache_key(accepted), name="block 2"))
    found = verdict(view, witness, SPEC)
    assert found is not None and found[0] == "7-kv-provenance", found
    assert "cache block 2 is filed under key" in found[1] and "its KV was written for 8 tokens" in found[1], found
    # filed under the drafts' own prefix, the KV matches its key: a hit there reads what it claims
    view.cached[-1] = replace(view.cached[-1], key=Keys().cache_key([30, 31, 32, 33, 34, 20, 21, 22]))
    assert verdict(view, witness, SPEC) is None
    # but a request that counts position 7 as computed reads the rejected draft's KV there
    witness.computed[1] = 8
    found = verdict(view, witness, SPEC)
    assert found is not None and found[0] == "7-kv-provenance" and "uid 1: position 7 reads location 11" in found[1]
