"""Radix cache details: LRU order by the logical clock, cascading eviction, copies not views,
and eviction that never walks the whole tree; fast's own check, its heap of evictable leaves, and
keys the generators never draw (token ids above 256, prefixes longer than 256 tokens)."""

import pytest
import torch

from kvledger import fast
from tests.support.impls import as_list


def _ids(impl, xs):
    return xs if impl.__name__ == "kvledger.reference" else torch.tensor(xs, dtype=torch.int32)


def _cache(impl, page_size=1):
    return impl.RadixPrefixCache(page_size)


def test_lru_evicts_least_recently_matched_leaf_first(impl):
    c = _cache(impl)
    c.insert_prefix(_ids(impl, [1, 1]), _ids(impl, [10, 11]))
    c.insert_prefix(_ids(impl, [2, 2]), _ids(impl, [20, 21]))
    c.insert_prefix(_ids(impl, [3, 3]), _ids(impl, [30, 31]))
    c.match_prefix(_ids(impl, [1, 1]))  # [1,1] is now the most recent
    assert as_list(c.evict(1)) == [20, 21]
    assert as_list(c.evict(3)) == [30, 31, 10, 11]
    assert c.size_info.total_size == 0


def test_eviction_cascades_to_a_parent_that_becomes_an_unlocked_leaf(impl):
    c = _cache(impl)
    c.insert_prefix(_ids(impl, [1, 2, 3]), _ids(impl, [0, 1, 2]))
    c.insert_prefix(_ids(impl, [1, 2, 4]), _ids(impl, [0, 1, 3]))  # splits [1,2 | 3]
    assert as_list(c.evict(3)) in ([2, 3, 0, 1], [3, 2, 0, 1])
    assert c.size_info.total_size == 0


def test_locked_path_is_never_evicted(impl):
    c = _cache(impl, page_size=2)
    _, handle = c.insert_prefix(_ids(impl, [1, 2, 3, 4]), _ids(impl, [0, 1, 2, 3]))
    c.lock_handle(handle)
    with pytest.raises(RuntimeError, match="evictable"):
        c.evict(2)
    c.lock_handle(handle, unlock=True)
    assert as_list(c.evict(2)) == [0, 1, 2, 3]


def test_values_are_copies_not_views_of_the_page_table():
    page_table = torch.arange(8, dtype=torch.int32).reshape(1, 8)
    c = fast.RadixPrefixCache(2)
    c.insert_prefix(torch.tensor([1, 2, 3, 4]), page_table[0, :4])
    c.insert_prefix(torch.tensor([1, 2, 5, 6]), page_table[0, 4:8])  # splits a node: copies again
    page_table.fill_(-1)
    assert sorted(v for node in c.nodes() for v in node.value.tolist()) == [0, 1, 2, 3, 6, 7]


def test_eviction_does_not_walk_the_tree(monkeypatch):
    c = fast.RadixPrefixCache(1)
    for i in range(2000):
        c.insert_prefix(torch.tensor([i // 256, i % 256, 7]), torch.tensor([3 * i, 3 * i + 1, 3 * i + 2]))
    monkeypatch.setattr(fast.RadixPrefixCache, "nodes", lambda self: pytest.fail("evict walked the tree"))
    popped = []
    real_pop = fast.radix_cache.heapq.heappop
    monkeypatch.setattr(fast.radix_cache.heapq, "heappop", lambda h: popped.append(1) or real_pop(h))
    evicted = c.evict(1)
    assert 1 <= len(evicted) <= 3 and len(popped) <= 2  # one leaf, at most a stale entry skipped


# -- fast's radix cache: its check, eviction, heap rebuilds, keys the generators never draw ------
# Mutation killers (`kvledger mutation`, properties/mutation.toml; results/mutation/README.md lists
# what survives): the lockstep run cannot see a mutant of code both sides share, of a check a correct
# run never trips, or of arithmetic that differs only on inputs the generators never draw (page sizes
# that are not powers of two, token ids above 256, uids that are not small ints). The tests below pin
# fast's radix cache down with numbers worked out by hand.
def test_fast_radix_check_finds_a_value_longer_than_its_key():
    cache = fast.RadixPrefixCache(2)
    _, handle = cache.insert_prefix(torch.tensor([1, 2, 3, 4]), torch.tensor([8, 9, 10, 11], dtype=torch.int32))
    cache.check_integrity()
    node = handle.node
    node.value = torch.tensor([8, 9, 10, 11, 12, 13], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="key length 4"):
        cache.check_integrity()


def test_radix_cache_evicts_exactly_what_is_asked_and_refuses_a_second_unlock():
    cache = fast.RadixPrefixCache(1)
    _, handle = cache.insert_prefix(torch.tensor([1, 2, 3]), torch.tensor([7, 8, 9], dtype=torch.int32))
    _, other = cache.insert_prefix(torch.tensor([1, 5]), torch.tensor([7, 4], dtype=torch.int32))
    assert len(cache.evict(0)) == 0 and cache.size_info.evictable_size == 4
    cache.lock_handle(handle)
    cache.lock_handle(handle, unlock=True)
    with pytest.raises(RuntimeError, match=r"^unlock of node \d+ whose lock count is already 0$"):
        cache.lock_handle(handle, unlock=True)
    assert cache.evict(1).tolist() in ([4], [8, 9])  # one leaf: the least recently used
    assert cache.size_info.evictable_size in (3, 2)


def test_rebuilding_the_radix_heap_keeps_every_evictable_leaf():
    cache = fast.RadixPrefixCache(1)
    handles = []
    for first in range(4):
        ids = torch.tensor([first, 1, 2])
        _, handle = cache.insert_prefix(ids, torch.arange(3 * first, 3 * first + 3, dtype=torch.int32))
        handles.append(handle)
    for _ in range(100):  # each unlock re-enters its leaf: past 4 * nodes + 64 entries the heap is rebuilt,
        cache.lock_handle(handles[0])  # and the other three leaves' only entries must survive that
        cache.lock_handle(handles[0], unlock=True)
    assert cache.size_info.evictable_size == 12
    assert sorted(cache.evict(12).tolist()) == list(range(12))
    assert cache.size_info.evictable_size == 0 and cache.nodes() == []


def test_prefix_matching_compares_token_ids_by_value():
    from kvledger.engine.ledger.trace import Header
    from kvledger.properties.lockstep import Lockstep

    lock = Lockstep(Header(num_pages=32, page_size=1, cache_type="radix", table_slots=4, max_seq_len=16))
    big = [int(str(t)) for t in (50000, 50001, 50002, 50003)]
    lock.apply({"op": "submit", "uid": 0, "tokens": big, "max_tokens": 1})
    lock.apply({"op": "prefill", "budget": 64})
    probe = lock.apply({"op": "probe", "tokens": [50000, 50001, 7]})
    assert probe.cached_len == 2
    lock.apply({"op": "submit", "uid": 1, "tokens": [50000, 50001, 50002, 9, 9], "max_tokens": 1})
    lock.apply({"op": "prefill", "budget": 64})
    assert lock.fast.cm.prefix_cache.size_info.evictable_size == 6


def test_prefixes_longer_than_256_tokens_match_whole():
    from kvledger.engine.ledger.trace import Header
    from kvledger.properties.lockstep import Lockstep

    lock = Lockstep(Header(num_pages=1024, page_size=1, cache_type="radix", table_slots=4, max_seq_len=700))
    prompt = [t % 7 for t in range(300)]
    lock.apply({"op": "submit", "uid": 0, "tokens": prompt, "max_tokens": 1})
    lock.apply({"op": "prefill", "budget": 1024})  # 300 tokens cached in one node
    assert lock.apply({"op": "probe", "tokens": prompt}).cached_len == 300
    lock.apply({"op": "submit", "uid": 1, "tokens": prompt + [1, 2, 3], "max_tokens": 1})
    lock.apply({"op": "prefill", "budget": 1024})
    lock.apply({"op": "submit", "uid": 2, "tokens": prompt + [1, 2, 3, 4, 5], "max_tokens": 2})
    assert lock.apply({"op": "probe", "tokens": prompt + [1, 2, 3, 4]}).cached_len == 303
    assert lock.apply({"op": "prefill", "budget": 1024}).batch == (2,)
    assert lock.apply({"op": "probe", "tokens": prompt + [1, 2, 3, 4, 5]}).cached_len == 305
    lock.apply({"op": "submit", "uid": 3, "tokens": prompt, "max_tokens": 1})
    lock.apply({"op": "prefill", "budget": 1024})  # ends: inserts 300 tokens that are all cached already
