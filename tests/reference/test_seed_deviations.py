"""Regressions for the places where the seed's code breaks an invariant (docs/deviations-from-the-seed.md).

Each deviation has a test that patches the seed's behaviour back into `fast` (it is in the bug
zoo) and watches the invariant break, and one that shows ours holding it on both implementations.
"""

import pytest
import torch

from kvledger import fast
from kvledger.engine.ledger.cache_scheduler import CacheScheduler, InvariantViolation
from kvledger.engine.ledger.ops import OpResult
from kvledger.subjects.fast_zoo import patched
from tests.support.impls import as_list


def _tiny_requests(d):
    for uid in range(4):  # each needs 3 tokens = 1 page of 4; the pool has 3 pages
        d.submit(uid, [uid, uid], 1)


def test_seed_reservation_in_tokens_overcommits_pages():
    d = CacheScheduler(fast, num_pages=3, page_size=4, cache_type="naive", table_slots=4, max_seq_len=16)
    _tiny_requests(d)
    with patched("reservation-in-tokens"), pytest.raises(InvariantViolation, match="3-no-oom"):
        d.prefill(100)  # 4 x 3 tokens <= 12 admits all four; they need 4 pages


def test_reservation_in_pages_admits_only_what_fits(impl):
    d = CacheScheduler(impl, num_pages=3, page_size=4, cache_type="naive", table_slots=4, max_seq_len=16)
    _tiny_requests(d)
    assert d.prefill(100) == OpResult(batch=(0, 1, 2), refused=3)
    d.check()


def _same_prefix_pair(impl):
    d = CacheScheduler(impl, num_pages=16, page_size=2, cache_type="radix", table_slots=4, max_seq_len=32)
    d.submit(0, [1, 2, 3, 4, 5], 4)
    d.submit(1, [1, 2, 3, 4, 6], 4)  # the same 4-token prefix, prefilled in the same batch
    assert d.prefill(100).batch == (0, 1)
    return d


def test_seed_cache_req_leaves_a_running_row_on_freed_pages():
    with patched("no-remap-on-duplicate"):
        d = _same_prefix_pair(fast)
    with pytest.raises(InvariantViolation, match="row does not start with the 4 locations of the prefix it locked"):
        d.check()


def test_cache_req_remaps_a_running_row_to_the_cached_copy(impl):
    d = _same_prefix_pair(impl)
    d.check()
    first, second = (as_list(d.cm.page_table[d.live[u].table_idx][:4]) for u in (0, 1))
    assert first == second  # uid 1 reads the cache's copy; its own duplicate pages are free
    for _ in range(3):
        d.decode([7])
        d.check()
    assert not d.live and len(d.cm.free_slots) * 2 + d.cm.prefix_cache.size_info.total_size == 32


def _free_then_rewrite_row():
    page_table = fast.make_page_table(2, 8)
    cm = fast.CacheManager(8, 1, page_table, "naive")
    page_table[0, :3] = torch.tensor([5, 6, 7], dtype=torch.int32)
    with cm.lazy_free_region():
        cm._free(page_table[0, :3])
        page_table[0, :3] = torch.tensor([0, 1, 2], dtype=torch.int32)  # the row is rewritten
    return as_list(cm.free_slots)[-3:]


def test_seed_lazy_free_of_views_frees_the_rewritten_row():
    with patched("lazy-free-holds-views"):
        assert _free_then_rewrite_row() == [0, 1, 2]


def test_lazy_free_keeps_copies_not_views_of_the_page_table():
    assert _free_then_rewrite_row() == [5, 6, 7]


def test_decode_order_is_admission_order_so_traces_replay(impl):
    """The seed keeps running requests in a set (hash order); we keep admission order."""
    dm = impl.DecodeManager(1)

    class R:
        def __init__(self, uid):
            self.uid, self.can_decode = uid, True

    reqs = [R(u) for u in (5, 1, 9, 3)]
    dm.filter_reqs(reqs)
    assert dm.running_reqs.uids() == [5, 1, 9, 3]
