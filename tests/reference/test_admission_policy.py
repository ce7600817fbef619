"""The admission policy (reference/admission_policy.py): its validation, which kinds preempt, and the
observed output ratio's window, minimum sample count and clipping."""

# Mutation killers (`kvledger mutation`, properties/mutation.toml; results/mutation/README.md lists
# what survives): the lockstep run cannot see a mutant of code both sides share, of a check a correct
# run never trips, or of arithmetic that differs only on inputs the generators never draw (page sizes
# that are not powers of two, token ids above 256, uids that are not small ints). Each test here pins
# one of those down with numbers worked out by hand.

from __future__ import annotations

import dataclasses

import pytest

from kvledger.reference.admission_policy import AdmissionPolicy


def test_admission_policy_validation():
    for bad in (True, "0.5", -0.1, 1.5):
        with pytest.raises(ValueError, match=r"^reserve_ratio must be a number in \[0, 1\], got"):
            AdmissionPolicy("optimistic", bad)
    for ok in (0, 0.0, 1, 1.0):
        AdmissionPolicy("optimistic", ok)
    assert [AdmissionPolicy(k).preempts for k in ("reserve", "optimistic", "adaptive")] == [False, True, True]
    assert AdmissionPolicy("".join(["re", "serve"])).preempts is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        AdmissionPolicy().kind = "optimistic"


def test_observed_output_ratio_window_samples_and_clipping():
    from kvledger.reference.admission_policy import ObservedOutputRatio

    r = ObservedOutputRatio(0.5)
    for _ in range(7):
        assert r.observe(0, 4) == 0.5  # fewer than eight samples: the configured ratio
    assert r.observe(4, 4) == 0.125
    for _ in range(92):
        r.observe(0, 4)
    assert r.ratio == 0.01  # 100 samples, one of them 1.0
    for _ in range(7):
        r.observe(0, 4)
    assert r.ratio == 0.01  # the 1.0 was the 8th: still among the last 100
    r.observe(0, 4)
    assert r.ratio == 0.0  # the window keeps the last 100
    clip = ObservedOutputRatio(0.5, min_samples=1)
    assert clip.observe(9, 4) == 1.0 and clip.observe(-4, 4) == 0.5 and clip.observe(1, 4) == 5 / 12
    assert ObservedOutputRatio(0.3, window=2, min_samples=2).observe(3, 4) == 0.3
