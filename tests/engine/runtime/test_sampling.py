"""The sampler never produces NaN or an empty distribution, whatever the parameters (the server's
top_p=1e-46 request once killed the engine), and a row it cannot sample fails that request alone."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.engine.runtime.sampling import Sampler, filter_logits, validate_sampling
from kvledger.fast import SamplingParams

VOCAB = 64

tiny_or_any_top_p = st.one_of(
    st.sampled_from([5e-324, 1e-46, 1e-300, 1e-8, 0.5, 1.0]), st.floats(min_value=5e-324, max_value=1.0)
)
temperatures = st.one_of(st.sampled_from([1e-300, 1e-5, 0.7, 2.0, 100.0]), st.floats(min_value=1e-300, max_value=1e6))


@settings(max_examples=300, deadline=None)
@given(
    logits=st.lists(st.floats(min_value=-1e4, max_value=1e4), min_size=VOCAB, max_size=VOCAB),
    temperature=temperatures,
    top_k=st.sampled_from([-1, 1, 2, 5, VOCAB, 10**9]),
    top_p=tiny_or_any_top_p,
    seed=st.integers(0, 2**32),
)
def test_filtering_keeps_the_most_likely_token_and_sampling_never_fails(logits, temperature, top_k, top_p, seed):
    row = torch.tensor(logits, dtype=torch.float32)
    kept = filter_logits(row, temperature, top_k, top_p)
    assert not torch.isnan(kept).any()
    assert torch.isfinite(kept[row == row.max()]).any()  # a most likely token always survives
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    sampler = Sampler()
    sampler.add(0, params)
    result = sampler.sample(row[None], [0], [params])
    assert result.failed == {}
    assert 0 <= result.tokens[0] < VOCAB and torch.isfinite(kept[result.tokens[0]])
    if top_p < 1e-30:  # nothing but the most likely token(s) can be drawn
        assert row[result.tokens[0]] == row.max()


def test_top_p_crossing_token_is_kept():
    row = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    kept = filter_logits(row, 1.0, -1, 0.6)
    assert torch.isfinite(kept).tolist() == [True, True, False]


def test_a_non_finite_row_fails_that_request_alone():
    sampler = Sampler()
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, seed=2)]
    for uid, p in enumerate(params):
        sampler.add(uid, p)
    logits = torch.zeros(2, VOCAB)
    logits[1, 3] = math.nan
    result = sampler.sample(logits, [0, 1], params)
    assert set(result.failed) == {1} and "non-finite" in result.failed[1]
    assert 0 <= result.tokens[0] < VOCAB


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("temperature", math.nan, "temperature"),
        ("temperature", math.inf, "temperature"),
        ("temperature", -1.0, "temperature"),
        ("top_p", math.nan, "top_p"),
        ("top_p", 0.0, "top_p"),
        ("top_k", 0, "top_k"),
        ("top_k", 2.5, "top_k"),
        ("max_tokens", True, "max_tokens"),
        ("seed", 2**64, "seed"),
        ("seed", "7", "seed"),
        ("stop_token_ids", (1, "x"), "stop_token_ids"),
    ],
)
def test_offline_sampling_params_are_validated(field, value, words):
    with pytest.raises(ValueError, match=words):
        validate_sampling(SamplingParams(**{field: value}))
