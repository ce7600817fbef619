"""The reference model's CacheManager: without rows, `finished` by keyword only, each corruption its
integrity check reports (with the numbers in the message), and rows that keep their width."""

# Mutation killers (`kvledger mutation`, properties/mutation.toml; results/mutation/README.md lists
# what survives): the lockstep run cannot see a mutant of code both sides share, of a check a correct
# run never trips, or of arithmetic that differs only on inputs the generators never draw (page sizes
# that are not powers of two, token ids above 256, uids that are not small ints). Each test here pins
# one of those down with numbers worked out by hand.

from __future__ import annotations

import pytest

from kvledger import reference
from kvledger.reference.cache_manager import IntegrityError
from tests.support.ledger import live_scheduler, sched


def test_reference_cache_manager_without_rows_and_finished_by_keyword():
    reference.CacheManager(1, 3, [], "naive")  # no rows: nothing to check
    s = sched(reference)
    s.submit(0, [1, 2], 2)
    s.prefill(64)
    with pytest.raises(TypeError):
        s.cm.cache_req(s.live[0], True)


def test_reference_integrity_reports_each_corruption():
    s, cm, reqs = live_scheduler(reference)
    cm.check_integrity(reqs)
    cm.free_slots.append(cm.free_slots[0])
    with pytest.raises(IntegrityError, match="^integrity: a page is in the free list twice$"):
        cm.check_integrity(reqs)
    cm.free_slots.pop()
    lost = cm.free_slots.pop(0)
    with pytest.raises(IntegrityError) as e:
        cm.check_integrity(reqs)
    assert (
        str(e.value) == f"integrity: 1 pages without exactly one owner, e.g. page {lost // 4} "
        f"(location {lost}) owned by nobody"
    )
    second = cm.free_slots.pop(0)
    with pytest.raises(IntegrityError) as e:
        cm.check_integrity(reqs)
    first = min(lost, second)
    assert (
        str(e.value) == f"integrity: 2 pages without exactly one owner, e.g. page {first // 4} "
        f"(location {first}) owned by nobody"
    )
    cm.free_slots[:0] = [lost, second]
    cached = cm.page_table[0][0]
    cm.free_slots.append(cached)
    with pytest.raises(IntegrityError) as e:
        cm.check_integrity(reqs)
    assert str(e.value).startswith(
        f"integrity: 1 pages without exactly one owner, e.g. page {cached // 4} (location {cached}) owned by ["
    )
    cm.free_slots.pop()
    row = cm.page_table[0]
    for delta in (1, -1):
        row[9] += delta
        with pytest.raises(IntegrityError, match="^integrity: request 0's row is not page-contiguous at 9$"):
            cm.check_integrity(reqs)
        row[9] -= delta
        row[0] += delta
        with pytest.raises(IntegrityError, match="^integrity: request 0's row does not match its locked prefix$"):
            cm.check_integrity(reqs)
        row[0] -= delta
    handle = reqs[0].cache_handle
    cm.unlock(handle)
    with pytest.raises(IntegrityError) as e:
        cm.check_integrity(reqs)
    assert str(e.value) == f"integrity: radix node {handle.node.id} has lock count 0, but 1 live requests hold it"
    cm.lock(handle)
    s.submit(1, [60, 61, 62, 63, 64], 1)
    s.prefill(64)
    stray = cm.match_req(reference.PendingReq(9, [60, 61, 62, 63, 64], reference.SamplingParams(max_tokens=1)))
    cm.lock(stray.cuda_handle)
    with pytest.raises(IntegrityError) as e:
        cm.check_integrity(reqs)
    assert str(e.value) == (
        f"integrity: radix node {stray.cuda_handle.node.id} has lock count 1, but 0 live requests hold it"
    )


def test_reference_page_table_rows_keep_their_width_as_pages_are_allocated():
    s = sched(reference, num_pages=64, page_size=2, table_slots=2, max_seq_len=40)
    s.submit(0, [1, 2, 3], 30)
    s.prefill(64)
    for _ in range(28):  # one token short of the end: still live
        s.decode()
        assert [len(row) for row in s.page_table] == [40, 40]
    row = s.page_table[s.live[0].table_idx]
    assert all(row[p] == row[p - p % 2] + p % 2 for p in range(32))
