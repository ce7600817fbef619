"""fast's speculative decoding against the reference's: the same lengths, tokens and page moves for
the same drafts, accepts and bonus tokens (fast writes the arithmetic again, so it is tested again)."""

from __future__ import annotations

import pytest

from kvledger import fast, reference


def _pair(tokens, max_tokens, ps, pages, cache="radix"):
    out = []
    for impl in (reference, fast):
        table = impl.make_page_table(1, 32)
        cm = impl.CacheManager(pages, ps, table, cache)
        params = impl.SamplingParams(max_tokens=max_tokens)
        req = impl.Req(list(tokens), 0, 0, max_tokens, 5, params, impl.CacheHandle(0))
        out.append((cm, req, table))
    return out


def _state(cm, req, table):
    ids = req.input_ids.tolist() if hasattr(req.input_ids, "tolist") else list(req.input_ids)
    row = table[0].tolist() if hasattr(table[0], "tolist") else list(table[0])
    free = cm.free_slots.tolist() if hasattr(cm.free_slots, "tolist") else list(cm.free_slots)
    return req.cached_len, req.device_len, ids, row[: req.cached_len], free, req.draft_room


@pytest.mark.parametrize("ps", [1, 2, 4])
@pytest.mark.parametrize("steps", [[(3, 0), (3, 3), (2, 1)], [(4, 2), (1, 1), (4, 0)]])
def test_fast_speculates_as_the_reference_does(ps, steps):
    sides = _pair([1, 2, 3], 12, ps, 32 // ps)
    for cm, req, _ in sides:
        cm.allocate_paged([req])
        req.complete_one()
        req.append_host(7)
    for k, accepted in steps:
        for cm, req, _ in sides:
            drafts = list(range(10, 10 + min(k, req.draft_room)))
            req.propose(drafts)
            cm.allocate_paged([req])
            cm.release_rejected(req, req.verify(min(accepted, len(drafts)), 9))
            cm.check_integrity([req])
        assert _state(*sides[0]) == _state(*sides[1])


def test_fast_refuses_what_the_reference_refuses():
    for _, req, _ in _pair([1, 2], 3, 1, 8):
        assert req.draft_room == 2  # device 2, max 5
        with pytest.raises(ValueError, match="^request 5: 3 drafts, room for 2$"):
            req.propose([0, 0, 0])
        req.propose([0])
        with pytest.raises(RuntimeError, match="drafts proposed twice"):
            req.propose([0])
        with pytest.raises(ValueError, match="^request 5: 2 drafts accepted of 1$"):
            req.verify(2, 0)
        assert req.verify(1, 4) == 3 and req.draft_room == 0
