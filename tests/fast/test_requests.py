"""fast's own request and table bookkeeping (written again on purpose, so tested again): 1-D token
tensors, a request's lengths and bounds, table slots handed out once."""

# Mutation killers (`kvledger mutation`, properties/mutation.toml; results/mutation/README.md lists
# what survives): the lockstep run cannot see a mutant of code both sides share, of a check a correct
# run never trips, or of arithmetic that differs only on inputs the generators never draw (page sizes
# that are not powers of two, token ids above 256, uids that are not small ints). Each test here pins
# one of those down with numbers worked out by hand.

from __future__ import annotations

import pytest
import torch

from kvledger import fast


def test_fast_token_tensors_are_one_dimensional():
    from kvledger.fast.requests import as_token_tensor

    assert as_token_tensor(torch.tensor([1, 2])).tolist() == [1, 2]
    for bad in (torch.tensor([[1, 2]]), torch.tensor(3)):
        with pytest.raises(ValueError, match="^input_ids must be 1-D, got shape"):
            as_token_tensor(bad)


def test_fast_requests_validate_count_and_bound_their_tokens():
    params = fast.SamplingParams(max_tokens=6)
    req = fast.Req([1, 2, 3, 4, 5], 0, 2, 6, 7, params, fast.CacheHandle(0))
    assert (req.device_len, req.max_device_len, req.remain_len, req.extend_len) == (5, 11, 6, 3)
    for cached, out in ((-1, 3), (5, 3), (6, 3), (0, -1)):
        with pytest.raises(ValueError) as e:
            fast.Req([1, 2, 3, 4, 5], 0, cached, out, 7, params, fast.CacheHandle(0))
        assert str(e.value) == (
            f"request 7: need 0 <= cached_len ({cached}) < device_len (5) <= max_device_len ({5 + out})"
        )
    fast.Req([1, 2], 0, 0, 0, 8, params, fast.CacheHandle(0))  # no output left: valid
    req.set_host_token(0, 9)
    req.set_host_token(4, 8)
    assert req.input_ids.tolist() == [9, 2, 3, 4, 8]
    for index in (-1, 5, 6):  # 6: inside the buffer, past the tokens
        with pytest.raises(IndexError, match=rf"^request 7: token index {index} outside \[0, 5\)$"):
            req.set_host_token(index, 5)
    long = fast.Req(list(range(290)), 0, 0, 10, 9, params, fast.CacheHandle(0))
    for t in range(10):
        long.append_host(t)
    with pytest.raises(RuntimeError, match=r"^request 9: no room for another token \(300 max\)$"):
        long.append_host(0)
    a, b = (fast.PendingReq(1, [1], fast.SamplingParams()) for _ in range(2))
    assert a != b and a.input_len == 1 and a.output_len == 1024


def test_fast_table_slots_are_handed_out_once():
    with pytest.raises(ValueError, match=r"^max_running_reqs \(3\) exceeds page_table rows \(2\)$"):
        fast.TableManager(3, fast.make_page_table(2, 12))
    tm = fast.TableManager(1, fast.make_page_table(2, 12))
    assert tm.available_size == 1 and tm.free_slots() == [0]
    with pytest.raises(RuntimeError, match="^table slot 0 freed twice$"):
        tm.free(0)
    assert tm.allocate() == 0 and tm.available_size == 0
    with pytest.raises(RuntimeError, match="^no free table slot$"):
        tm.allocate()
    tm.free(0)
    with pytest.raises(RuntimeError, match="^table slot 0 freed twice$"):
        tm.free(0)
    assert tm.free_slots() == [0]
