"""The reference's speculative decoding: a request's lookahead for its drafts, the commit of the
accepted ones and the bonus token, and the release of the rejected tail's pages (numbers by hand)."""

from __future__ import annotations

import pytest

from kvledger import reference


def _req(tokens, cached_len, max_tokens, table_idx=0):
    params = reference.SamplingParams(max_tokens=max_tokens)
    return reference.Req(list(tokens), table_idx, cached_len, max_tokens, 3, params, reference.CacheHandle(0))


def test_draft_room_keeps_the_bonus_token_within_max_tokens():
    req = _req([1, 2, 3], 2, 4)  # device 3, max 7: outputs 3..6
    assert req.draft_room == 3  # 3 drafts + the bonus reach token 7; the last gets no KV
    assert _req([1, 2, 3], 2, 1).draft_room == 0


def test_propose_extends_the_step_and_verify_commits_the_accepted_run():
    req = _req([1, 2, 3], 2, 6)
    req.propose([7, 8, 9])
    assert (req.cached_len, req.device_len, req.drafts) == (2, 6, [7, 8, 9])
    with pytest.raises(RuntimeError, match="drafts proposed twice"):
        req.propose([1])
    assert req.verify(1, 5) == 6  # the step's locations ended at position 6
    assert (req.cached_len, req.device_len, req.input_ids, req.drafts) == (4, 5, [1, 2, 3, 7, 5], [])


def test_verify_bounds_and_all_or_none_accepted():
    req = _req([1, 2], 1, 8)
    with pytest.raises(ValueError, match="room for"):
        req.propose([0] * 8)  # device 2, max 10: 8 drafts and the bonus would make 11 tokens
    req.propose([4, 4])
    with pytest.raises(ValueError, match="3 drafts accepted of 2"):
        req.verify(3, 0)
    assert req.verify(2, 6) == 4
    assert (req.cached_len, req.device_len, req.input_ids) == (4, 5, [1, 2, 4, 4, 6])
    req.propose([1, 1, 1])
    assert req.verify(0, 2) == 8
    assert (req.cached_len, req.device_len, req.input_ids) == (5, 6, [1, 2, 4, 4, 6, 2])


def test_release_rejected_frees_the_pages_past_the_committed_one():
    table = reference.make_page_table(1, 16)
    cm = reference.CacheManager(8, 2, table, "radix")
    req = _req([1, 2, 3], 0, 8)
    cm.allocate_paged([req])  # the prompt: positions 0-2 on two pages
    req.complete_one()
    req.append_host(9)  # cached 3, device 4
    req.propose([4, 5, 6, 7])  # the step computes positions [3, 8): two more pages
    cm.allocate_paged([req])
    assert len(cm.free_slots) == 4
    rejected_page = table[0][6]
    reserved_end = req.verify(1, 9)  # KV committed through position 4 (its page: 4-5), the bonus at 5
    assert (reserved_end, req.cached_len, req.device_len) == (8, 5, 6)
    cm.release_rejected(req, reserved_end)  # the page of positions 6-7 goes back
    assert cm.free_slots[-1] == rejected_page and len(cm.free_slots) == 5
    cm.check_integrity([req])


def test_release_rejected_keeps_the_page_the_commit_ends_in():
    table = reference.make_page_table(1, 16)
    cm = reference.CacheManager(4, 4, table, "naive")
    req = _req([1, 2, 3], 0, 8)
    req.propose([4])  # positions [0, 4): the first page alone
    cm.allocate_paged([req])
    cm.release_rejected(req, req.verify(0, 5))  # committed through position 2, inside that page
    assert len(cm.free_slots) == 3  # nothing past the committed page was taken, nothing freed
    cm.check_integrity([req])
