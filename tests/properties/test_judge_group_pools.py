"""The judge's clauses for a KV group with a pool of its own (`Capabilities.group_pools`,
properties/group_judge.py: own_pools, check_pools, check_group_counters).

The views are shaped like SGLang's SWA allocator on this box (notes/field-paths.md section 6):
page size 4, a full-attention pool of pages 1..6 and an SWA pool shown as pages 8..13 (the SWA
pool's page 0, its padding page, would be 7). uid 1 computed a 12-token prompt; the window of 8
tokens reads [5, 12), and a checkpoint freed the SWA slots of positions [0, 4): its SWA row holds
None there. Each test breaks one thing in that sound state and checks the judge names it."""

from __future__ import annotations

from dataclasses import replace
from typing import List, Sequence

import pytest

from kvledger.engine.ledger.invariants import InvariantViolation
from kvledger.properties.subject import Capabilities, GroupView, View
from kvledger.properties.subject_judge import Witness, judge

PS = 4
WINDOW = 8
PROMPT = list(range(30, 42))  # 12 tokens
FULL_POOL = tuple(range(1, 7))
SWA_POOL = tuple(range(8, 14))
CAPS = Capabilities(
    page_size=PS,
    pages=FULL_POOL,
    worst_case_admission=False,
    preempts=True,
    explicit_evict=True,
    cached_pages_in_free_pool=False,
    group_pools=(SWA_POOL,),
)


def row(pages: Sequence[int | None], n: int) -> List[int | None]:
    return [None if pages[p // PS] is None else pages[p // PS] * PS + p % PS for p in range(n)]  # type: ignore[operator]


def sound() -> tuple[View, Witness]:
    witness = Witness()
    witness.tokens[1] = PROMPT + [7]
    witness.prompt_len[1] = len(PROMPT)
    full, window = row([1, 2, 3], 12), row([8, 9, 10], 12)
    written = View(free=[], requests={1: full}, groups=[GroupView("swa", WINDOW, {1: window})])
    witness.wrote_view(written, 1, witness.tokens[1], 0, 12)
    witness.computed[1] = 12
    view = View(
        free=[4, 5, 6],
        requests={1: row([1, 2, 3], 12)},
        counters={"free_pages": 3},
        groups=[
            GroupView(
                "swa",
                WINDOW,
                {1: row([None, 9, 10], 12)},
                free=[11, 12, 13, 8],
                counters={"free_pages": 4, "cached_tokens": 0},
            )
        ],
    )
    return view, witness


def swa(view: View, **changes: object) -> View:
    return replace(view, groups=[replace(view.groups[0], **changes)])


def test_the_sound_state_passes() -> None:
    view, witness = sound()
    judge(view, CAPS, witness)


def test_an_swa_page_in_the_full_free_list() -> None:
    view, witness = sound()
    with pytest.raises(InvariantViolation, match="1-2-partition.*the free list holds 11, not a page of the pool"):
        judge(replace(view, free=[4, 5, 6, 11]), CAPS, witness)


def test_a_full_page_in_the_swa_free_list() -> None:
    view, witness = sound()
    with pytest.raises(InvariantViolation, match="1-2-partition.*the free list holds 4"):
        judge(swa(view, free=[11, 12, 13, 8, 4]), CAPS, witness)


def test_an_swa_row_on_a_page_of_the_full_pool() -> None:
    view, witness = sound()
    crossed = swa(view, requests={1: row([None, 9, 4], 12)}, free=[11, 12, 13, 8, 10])
    with pytest.raises(InvariantViolation, match="1-2-partition.*holds page 4, which is a page of the first pool"):
        judge(replace(crossed, free=[5, 6]), CAPS, witness)


def test_an_swa_page_leaked() -> None:
    view, witness = sound()
    with pytest.raises(InvariantViolation, match="1-2-partition.*page 8 is owned by nobody"):
        judge(swa(view, free=[11, 12, 13], counters={"free_pages": 3}), CAPS, witness)


def test_an_swa_page_freed_and_still_in_the_row() -> None:
    view, witness = sound()
    with pytest.raises(InvariantViolation, match="1-2-partition.*page 9 is free, but live uid"):
        judge(swa(view, free=[11, 12, 13, 8, 9], counters={"free_pages": 5}), CAPS, witness)


def test_the_swa_counters_count_their_own_pool() -> None:
    view, witness = sound()
    with pytest.raises(InvariantViolation, match=r"9-counters.*free_pages = 3 in group 1 \(swa, window 8\)"):
        judge(swa(view, counters={"free_pages": 3}), CAPS, witness)


def test_a_group_with_its_own_pool_shows_its_free_list() -> None:
    view, witness = sound()
    with pytest.raises(InvariantViolation, match="1-2-partition.*a pool of its own but the view shows no free list"):
        judge(swa(view, free=None), CAPS, witness)


def test_a_window_position_dropped_is_read() -> None:
    view, witness = sound()
    dropped = swa(view, requests={1: row([None, None, 10], 12)}, free=[11, 12, 13, 8, 9], counters={"free_pages": 5})
    with pytest.raises(InvariantViolation, match="7-kv-provenance.*position 5 has no location"):
        judge(dropped, CAPS, witness)
