"""The reference model's prefix caches: defaults and frozen handles, the naive cache that holds
nothing, the radix tree's own check and unlock, and the note an eviction leaves."""

# Mutation killers (`kvledger mutation`, properties/mutation.toml; results/mutation/README.md lists
# what survives): the lockstep run cannot see a mutant of code both sides share, of a check a correct
# run never trips, or of arithmetic that differs only on inputs the generators never draw (page sizes
# that are not powers of two, token ids above 256, uids that are not small ints). Each test here pins
# one of those down with numbers worked out by hand.

from __future__ import annotations

import dataclasses

import pytest

from kvledger import reference


def test_reference_prefix_cache_basics():
    from kvledger.reference.prefix_cache import SizeInfo

    assert SizeInfo(3, 5).total_size == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        reference.CacheHandle(1).cached_len = 2
    naive = reference.NaivePrefixCache()
    assert naive.page_size == 1 and reference.RadixPrefixCache().page_size == 1
    assert list(naive.evict(0)) == []
    with pytest.raises(RuntimeError, match="the naive cache holds none"):
        naive.evict(1)
    assert reference.DecodeManager().page_size == 1 and reference.DecodeManager().runnable is False


def test_reference_radix_check_and_unlock():
    cache = reference.RadixPrefixCache(2)
    _, handle = cache.insert_prefix([1, 2, 3, 4], [8, 9, 10, 11])
    cache.check_integrity()
    cache.lock_handle(handle)
    cache.lock_handle(handle, unlock=True)
    with pytest.raises(RuntimeError, match=r"^unlock of node \d+ whose lock count is already 0$"):
        cache.lock_handle(handle, unlock=True)
    for delta in (1, -1):
        cache.evictable_size += delta
        with pytest.raises(
            RuntimeError, match=f"radix sizes recount to evictable=4 protected=0, recorded {4 + delta} 0"
        ):
            cache.check_integrity()
        cache.evictable_size -= delta
    node = handle.node
    node.key, node.value = node.key[:3], node.value[:3]
    with pytest.raises(RuntimeError, match="has key length 3, value length 3"):
        cache.check_integrity()
    node.key, node.value = [1, 2, 3, 4], [8, 9, 10]
    with pytest.raises(RuntimeError, match="has key length 4, value length 3"):
        cache.check_integrity()
    node.key, node.value = [1, 2], [8, 9, 10]
    with pytest.raises(RuntimeError, match="has key length 2, value length 3"):
        cache.check_integrity()
    node.key, node.value = [], []
    with pytest.raises(RuntimeError, match="has key length 0, value length 0"):
        cache.check_integrity()


def test_evicting_a_leaf_notes_its_parent_only_when_that_becomes_an_evictable_leaf(noted):
    cache = reference.RadixPrefixCache(1)
    cache.insert_prefix([1, 2, 3], [10, 11, 12])
    cache.insert_prefix([1, 2, 4], [10, 11, 13])  # [1, 2] now has two children
    assert len(cache.evict(1)) == 1
    assert "radix: eviction makes the parent an evictable leaf" not in noted  # a sibling is left
    locked = reference.RadixPrefixCache(1)
    locked.insert_prefix([1, 2, 3], [10, 11, 12])
    handle = locked.match_prefix([1, 2]).cuda_handle  # splits off [1, 2] and locks it below
    locked.lock_handle(handle)
    assert locked.evict(1) == [12]
    assert "radix: eviction makes the parent an evictable leaf" not in noted  # the parent is locked
