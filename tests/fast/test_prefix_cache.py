"""fast's prefix caches apart from the radix tree's details (tests/fast/test_radix_cache.py): their
defaults, frozen handles, and the naive cache that never holds anything."""

# Mutation killers (`kvledger mutation`, properties/mutation.toml; results/mutation/README.md lists
# what survives): the lockstep run cannot see a mutant of code both sides share, of a check a correct
# run never trips, or of arithmetic that differs only on inputs the generators never draw (page sizes
# that are not powers of two, token ids above 256, uids that are not small ints). Each test here pins
# one of those down with numbers worked out by hand.

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvledger import fast


def test_fast_defaults_and_frozen_handles():
    assert fast.NaivePrefixCache().page_size == 1 and fast.RadixPrefixCache().page_size == 1
    assert fast.DecodeManager().page_size == 1
    handle = fast.CacheHandle(3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        handle.cached_len = 4


def test_naive_cache_evicts_nothing():
    cache = fast.NaivePrefixCache(2)
    assert (
        len(cache.evict(0)) == 0
        and len(cache.match_prefix(torch.tensor([1, 2, 3])).cuda_handle.get_matched_indices()) == 0
    )
    with pytest.raises(RuntimeError, match="^cannot evict 1 tokens: the naive cache holds none$"):
        cache.evict(1)
