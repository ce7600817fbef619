"""The reference model's requests, sampling parameters, running set and tables: their validation,
their counts and their defaults."""

# Mutation killers (`kvledger mutation`, properties/mutation.toml; results/mutation/README.md lists
# what survives): the lockstep run cannot see a mutant of code both sides share, of a check a correct
# run never trips, or of arithmetic that differs only on inputs the generators never draw (page sizes
# that are not powers of two, token ids above 256, uids that are not small ints). Each test here pins
# one of those down with numbers worked out by hand.

from __future__ import annotations

import pytest

from kvledger import reference


def test_reference_requests_validate_and_count():
    from kvledger.reference.requests import validate_pending

    params = reference.SamplingParams(max_tokens=3)
    req = reference.Req([1, 2, 3], 0, 1, 3, 7, params, reference.CacheHandle(0))
    assert (req.device_len, req.max_device_len, req.remain_len, req.extend_len) == (3, 6, 3, 2)
    assert req.can_decode
    for cached, ids, out in ((-1, [1, 2], 1), (2, [1, 2], 1), (3, [1, 2], 1), (0, [], 1), (0, [1, 2], -1)):
        with pytest.raises(ValueError, match=r"^request 7: need 0 <= cached_len"):
            reference.Req(ids, 0, cached, out, 7, params, reference.CacheHandle(0))
    done = reference.Req([1, 2], 0, 1, 0, 8, params, reference.CacheHandle(0))
    assert done.remain_len == 0 and not done.can_decode
    req.set_host_token(0, 9)
    req.set_host_token(2, 8)
    assert list(req.input_ids) == [9, 2, 8]
    for index in (-1, 3, 4):
        with pytest.raises(IndexError, match=rf"^request 7: token index {index} outside \[0, 3\)$"):
            req.set_host_token(index, 5)
    assert reference.Req([1, 2, 3, 4, 5], 0, 2, 1, 9, params, reference.CacheHandle(0)).extend_len == 3
    validate_pending(1, 1, reference.SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="input_ids is empty"):
        validate_pending(1, 0, params)
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        validate_pending(1, 1, reference.SamplingParams(max_tokens=0))
    a, b = (reference.PendingReq(1, [1], reference.SamplingParams()) for _ in range(2))
    assert a != b  # pending requests compare by identity


def test_sampling_params_defaults_and_greedy():
    p = reference.SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.ignore_eos, p.max_tokens) == (0.0, -1, 1.0, False, 1024)
    assert p.is_greedy is True
    greedy = {
        (0.0, -1, 1.0): True,
        (0.7, -1, 1.0): False,
        (0.7, 1, 1.0): True,
        (0.0, -1, 0.9): False,
        (-0.5, 5, 1.0): True,
        (0.7, 2, 1.0): False,
        (0.7, 0, 1.0): False,
        (0.0, 1, 1.5): False,
    }
    for (t, k, top_p), want in greedy.items():
        assert reference.SamplingParams(temperature=t, top_k=k, top_p=top_p).is_greedy is want, (t, k, top_p)


def test_running_reqs_contain_requests_not_uids():
    from kvledger.reference.running_reqs import RunningReqs

    params = reference.SamplingParams(max_tokens=2)
    req = reference.Req([1, 2], 0, 0, 2, 4, params, reference.CacheHandle(0))
    twin = reference.Req([1, 2], 1, 0, 2, 4, params, reference.CacheHandle(0))
    running = RunningReqs()
    running.add(req)
    assert req in running and twin not in running and object() not in running


def test_reference_tables_validate_and_start_zeroed():
    with pytest.raises(ValueError, match=r"^max_running_reqs \(3\) exceeds page_table rows \(2\)$"):
        reference.TableManager(3, reference.make_page_table(2, 4))
    tm = reference.TableManager(1, reference.make_page_table(2, 4))
    assert tm.token_pool == [[0] * 4, [0] * 4] and tm.page_table == [[0] * 4, [0] * 4]
    assert reference.make_page_table(1, 2, "".join(["c", "pu"])) == [[0, 0]]
    for device in ("cuda", "aaa"):
        with pytest.raises(ValueError, match="the reference model lives on the host"):
            reference.make_page_table(1, 2, device)
