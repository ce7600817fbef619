"""Radix cache details: LRU order by the logical clock, cascading eviction, copies not views,
and eviction that never walks the whole tree."""

import pytest
import torch

from kvledger import fast
from tests.conftest import as_list


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
