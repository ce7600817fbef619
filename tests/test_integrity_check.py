"""check_integrity is complete: each kind of corruption is caught, on both implementations."""

import pytest
import torch

from kvledger.engine.ledger.cache_scheduler import CacheScheduler


def _running(impl, cache="radix", page_size=2):
    d = CacheScheduler(impl, num_pages=16, page_size=page_size, cache_type=cache, table_slots=4, max_seq_len=32)
    d.submit(0, [1, 2, 3, 4, 5], 6)
    d.submit(1, [1, 2, 3, 4, 9, 9, 9], 6)
    d.prefill(100)
    d.decode([3])
    d.check()
    return d


def _set(impl, container, i, value):
    container[i] = value if impl.__name__ == "kvledger.reference" else torch.tensor(value, dtype=torch.int32)


def test_clean_state_passes(impl):
    _running(impl).cm.check_integrity(list(_running(impl).live.values()))


def test_page_in_free_list_twice(impl):
    d = _running(impl)
    d.cm.free_slots = d.cm.free_slots[:1] + d.cm.free_slots[:1] + d.cm.free_slots[2:]
    with pytest.raises(RuntimeError, match="integrity"):
        d.cm.check_integrity(list(d.live.values()))


def test_misaligned_free_slot(impl):
    d = _running(impl)
    _set(impl, d.cm.free_slots, 0, int(d.cm.free_slots[0]) + 1)
    with pytest.raises(RuntimeError, match="integrity"):
        d.cm.check_integrity(list(d.live.values()))


def test_page_both_free_and_owned(impl):
    d = _running(impl)
    req = d.live[0]
    owned = int(d.cm.page_table[req.table_idx][4])  # past the cached prefix: request-owned
    _set(impl, d.cm.free_slots, 0, owned)
    with pytest.raises(RuntimeError, match="integrity"):
        d.cm.check_integrity(list(d.live.values()))


def test_request_forgotten_is_a_leak(impl):
    d = _running(impl)
    with pytest.raises(RuntimeError, match="integrity"):
        d.cm.check_integrity([d.live[0]])  # uid 1's pages and lock are unaccounted


def test_lock_count_off_by_one(impl):
    d = _running(impl)
    d.cm.lock(d.live[0].cache_handle)  # a lock nobody will release
    with pytest.raises(RuntimeError, match="lock count"):
        d.cm.check_integrity(list(d.live.values()))


def test_radix_size_accounting(impl):
    d = _running(impl)
    d.cm.prefix_cache.evictable_size += 2
    with pytest.raises(RuntimeError, match="integrity"):
        d.cm.check_integrity(list(d.live.values()))


def test_row_pointing_outside_its_locked_prefix(impl):
    d = _running(impl)
    req = d.live[1]
    _set(impl, d.cm.page_table[req.table_idx], 0, int(d.cm.page_table[req.table_idx][0]) + 2)
    with pytest.raises(RuntimeError, match="integrity"):
        d.cm.check_integrity(list(d.live.values()))


def test_quiescence_every_page_back_and_no_lock(impl):
    d = _running(impl)
    for uid in d.dm.running_reqs.uids():
        d.finish(uid)
    d.check()
    info = d.cm.prefix_cache.size_info
    assert info.protected_size == 0
    assert len(d.cm.free_slots) * 2 + info.total_size == 32


def test_page_table_rows_must_hold_whole_pages(impl):
    with pytest.raises(ValueError, match="multiple of page_size"):
        impl.CacheManager(4, 4, impl.make_page_table(2, 10), "naive")


def test_a_request_ending_near_max_seq_len_fills_its_last_page(impl):
    """Found by the fuzzer: with max_seq_len 10 and page size 4 the last page reaches column 11."""
    d = CacheScheduler(impl, num_pages=8, page_size=4, cache_type="radix", table_slots=2, max_seq_len=10)
    d.submit(0, [1, 2, 3, 4, 5, 6, 7], 3)
    d.prefill(64)
    for _ in range(2):
        d.decode([1])
        d.check()
    assert not d.live
