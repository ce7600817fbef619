"""check_integrity is complete: each kind of corruption is caught, on both implementations; fast's
reports name the page and its owner counts."""

import pytest
import torch

from kvledger import fast
from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.reference.cache_manager import IntegrityError
from tests.support.ledger import live_scheduler, sched


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


def test_a_request_ending_near_max_seq_len_fills_its_last_page(impl):
    """Found by the fuzzer: with max_seq_len 10 and page size 4 the last page reaches column 11."""
    d = CacheScheduler(impl, num_pages=8, page_size=4, cache_type="radix", table_slots=2, max_seq_len=10)
    d.submit(0, [1, 2, 3, 4, 5, 6, 7], 3)
    d.prefill(64)
    for _ in range(2):
        d.decode([1])
        d.check()
    assert not d.live


# -- fast's integrity check: each corruption found, and reported with the right numbers ----------
# Mutation killers (`kvledger mutation`, properties/mutation.toml; results/mutation/README.md lists
# what survives): the lockstep run cannot see a mutant of code both sides share, of a check a correct
# run never trips, or of arithmetic that differs only on inputs the generators never draw (page sizes
# that are not powers of two, token ids above 256, uids that are not small ints). The tests below pin
# fast's messages down with numbers worked out by hand.
def test_integrity_reports_a_page_with_two_owners_with_its_counts():
    s, cm, reqs = live_scheduler(fast)
    cm.check_integrity(reqs)
    cached = cm.page_table[0][0].item()  # the request's first page: the cache holds it
    cm.free_slots = torch.cat([cm.free_slots, cm.free_slots.new_tensor([cached])])
    with pytest.raises(IntegrityError) as e:
        cm.check_integrity(reqs)
    page = cached // 4
    assert str(e.value) == (
        f"integrity: 1 pages without exactly one owner, e.g. page {page} (location {cached}) "
        f"has 2 owners; free=6 cached=2 owned=1"
    )


def test_integrity_reports_a_page_nobody_holds():
    s, cm, reqs = live_scheduler(fast)
    lost = cm.free_slots[0].item()
    cm.free_slots = cm.free_slots[1:]
    with pytest.raises(IntegrityError) as e:
        cm.check_integrity(reqs)
    assert str(e.value).startswith(
        f"integrity: 1 pages without exactly one owner, e.g. page {lost // 4} "
        f"(location {lost}) has 0 owners; free=4 cached=2 owned=1"
    )


@pytest.mark.parametrize("page_size,bad", [(4, 13), (4, 32), (4, 36), (1, -1), (4, -4)])
def test_integrity_rejects_a_misaligned_or_outside_page_start(page_size, bad):
    s = sched(fast, num_pages=8, page_size=page_size, max_seq_len=32)
    cm = s.cm
    cm.free_slots = torch.cat([cm.free_slots[1:], cm.free_slots.new_tensor([bad])])
    with pytest.raises(IntegrityError, match="misaligned or outside the pool"):
        cm.check_integrity([])


def test_integrity_rejects_a_row_that_is_not_page_contiguous():
    s, cm, reqs = live_scheduler(fast)
    row = cm.page_table[0]
    assert row[9].item() == row[8].item() + 1
    row[9] += 1  # inside the request's own page, past what the cache holds
    with pytest.raises(IntegrityError, match="^integrity: request 0's row is not page-contiguous$"):
        cm.check_integrity(reqs)


def test_integrity_rejects_lock_counts_that_do_not_match_the_live_requests():
    s, cm, reqs = live_scheduler(fast)
    handle = reqs[0].cache_handle
    node = handle.node
    cm.unlock(handle)  # a live request holds it, the count forgot
    with pytest.raises(IntegrityError) as e:
        cm.check_integrity(reqs)
    assert str(e.value) == f"integrity: radix node {node.id} has lock count 0, but 1 live requests hold it"
    cm.lock(handle)
    cm.check_integrity(reqs)
    s.submit(1, [60, 61, 62, 63, 64], 1)
    s.prefill(64)  # ends at once: its first page stays in the cache, unlocked
    stray = cm.match_req(fast.PendingReq(9, [60, 61, 62, 63, 64], fast.SamplingParams(max_tokens=1))).cuda_handle
    cm.lock(stray)  # nobody live holds it
    with pytest.raises(IntegrityError) as e:
        cm.check_integrity(reqs)
    assert str(e.value) == f"integrity: radix node {stray.node.id} has lock count 1, but 0 live requests hold it"
