"""The seed chapter's tests, self-test answers and 64-page example, on both implementations."""

import pytest

from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from tests.support.impls import as_list, make_manager, row


def _req(impl, cm, *, table_idx, prompt, cached_len=0, output_len=4):
    handle = cm.prefix_cache.match_prefix(prompt[:0]).cuda_handle
    ids = prompt if impl.__name__ == "kvledger.reference" else impl.requests.as_token_tensor(prompt)
    return impl.Req(ids, table_idx, cached_len, output_len, 0, impl.SamplingParams(max_tokens=output_len), handle)


def test_allocate_paged_writes_page_aligned_token_positions(impl):
    cm, _ = make_manager(impl, num_pages=8, page_size=4)
    req = _req(impl, cm, table_idx=2, prompt=list(range(6)))
    cm.allocate_paged([req])  # 6 tokens need 2 pages
    assert row(impl, cm, 2, 8) == [0, 1, 2, 3, 4, 5, 6, 7] and len(cm.free_slots) == 6
    req.complete_one()  # device_len 7: still inside the second page
    cm.allocate_paged([req])
    assert len(cm.free_slots) == 6
    req.complete_one()
    req.complete_one()  # device_len 9: a third page
    cm.allocate_paged([req])
    assert len(cm.free_slots) == 5 and row(impl, cm, 2, 9)[8] % 4 == 0


def test_integrity_check_detects_leak(impl):
    cm, _ = make_manager(impl, num_pages=8, page_size=1)
    cm.check_integrity()
    cm._allocate(3)  # allocated, handed to nobody
    with pytest.raises(RuntimeError, match="integrity"):
        cm.check_integrity()


def test_self_test_4_allocates_pages_ceil_cached_to_ceil_device(impl):
    cm, _ = make_manager(impl, num_pages=8, page_size=4)
    req = _req(impl, cm, table_idx=0, prompt=list(range(9)))
    req.cached_len = 6  # positions 0..5 already have KV in pages 0 and 1
    cm.page_table[0][0:8] = list(range(8)) if impl.__name__ == "kvledger.reference" else __import__("torch").arange(8)
    cm.free_slots = cm.free_slots[2:]
    cm.allocate_paged([req])  # device_len 9: pages [ceil(6/4), ceil(9/4)) = [2, 3)
    assert len(cm.free_slots) == 5
    assert row(impl, cm, 0, 12)[8:12] == [8, 9, 10, 11]


def test_self_test_3_match_stops_before_the_last_token(impl):
    d = CacheScheduler(impl, num_pages=16, page_size=1, cache_type="radix", table_slots=2, max_seq_len=32)
    prompt = [1, 2, 3, 4, 5]
    d.submit(0, prompt, 1)
    d.prefill(100)  # max_tokens 1: finishes at prefill, the whole prompt is cached
    assert d.probe(prompt[:-1] + [9]).cached_len == 4
    pending = impl.PendingReq(1, prompt, impl.SamplingParams(max_tokens=2))
    req = impl.PrefillAdder(100, 0, d.cm, d.tm).try_add_one(pending)
    assert req.cached_len == 4 and req.extend_len == 1  # the last prompt token is computed again


def test_self_test_2_available_size_counts_the_evictable_cache(impl):
    d = CacheScheduler(impl, num_pages=8, page_size=1, cache_type="radix", table_slots=2, max_seq_len=32)
    d.submit(0, [1, 2, 3, 4, 5, 6], 1)
    d.prefill(100)
    assert len(d.cm.free_slots) == 2 and d.cm.available_size == 8  # 6 pages cached, all evictable
    d.submit(1, [7, 7, 7, 7, 7, 7, 7], 1)  # needs 6 pages: fits only by evicting the cache
    assert d.prefill(100).batch == (1,)
    d.check()


def test_self_test_1_admitted_requests_never_run_out(impl):
    d = CacheScheduler(impl, num_pages=12, page_size=4, cache_type="radix", table_slots=8, max_seq_len=64)
    for uid in range(8):
        d.submit(uid, [uid % 2] * (3 + uid), 9)
    steps = 0
    while d.waiting or d.dm.runnable:
        if not (d.waiting and d.prefill(7).batch):
            d.decode([1])
        d.check()  # includes: live requests' worst case fits in what is available
        steps += 1
    assert steps > 8 and len(d.cm.free_slots) * 4 + d.cm.prefix_cache.size_info.total_size == 48


def test_the_seeds_64_page_example(impl):
    """Prompts of 5, 5, 4, 15, 5 tokens, max_tokens 8, page size 1, naive cache: the seed's table."""
    d = CacheScheduler(impl, num_pages=64, page_size=1, cache_type="naive", table_slots=8, max_seq_len=128)
    table = []
    d.after_forward = lambda phase, batch: table.append(
        (phase, [r.uid for r in batch], len(d.waiting), len(d.cm.free_slots), d.dm.inflight_tokens)
    )
    for uid, n in enumerate([5, 5, 4, 15, 5]):
        d.submit(uid, [100 * uid + i for i in range(n)], 8)
    while d.waiting or d.dm.runnable:
        if not (d.waiting and d.prefill(8192).batch):
            d.decode()
        d.check()
    first4, fifth = [0, 1, 2, 3], [4]
    assert table == (
        [("prefill", first4, 1, 35, 28)]
        + [("decode", first4, 1, 31 - 4 * i, 24 - 4 * i) for i in range(7)]
        + [("prefill", fifth, 0, 59, 7)]
        + [("decode", fifth, 0, 58 - i, 6 - i) for i in range(7)]
    )
    d.cm.check_integrity()
    assert len(d.cm.free_slots) == 64


@pytest.mark.parametrize("page_size", [4, 8])
def test_eviction_then_allocation_is_page_aligned_and_disjoint(impl, page_size):
    """The official repository's evict-then-allocate test: pages come back whole and aligned."""
    d = CacheScheduler(impl, num_pages=6, page_size=page_size, cache_type="radix", table_slots=4, max_seq_len=128)
    for uid in range(3):  # three cached prompts of 1.5 pages fill the cache
        d.submit(uid, [uid] * (page_size + page_size // 2 + 1), 1)
        d.prefill(1000)
    assert d.cm.prefix_cache.size_info.evictable_size == 3 * page_size
    d.submit(9, [7] * (5 * page_size), 1)  # five pages: must evict two cached ones
    assert d.prefill(1000).batch == (9,)
    owned = as_list(d.cm.page_table[d.live[9].table_idx][: 5 * page_size]) if 9 in d.live else None
    d.check()
    starts = as_list(d.cm.free_slots) + [
        n for node in d.cm.prefix_cache.nodes() for n in as_list(node.value)[::page_size]
    ]
    assert all(s % page_size == 0 for s in starts)
    assert len(set(starts)) == len(starts)
    if owned is not None:
        assert not set(owned[::page_size]) & set(starts)


def test_running_reqs_iterates_requests_in_admission_order_like_the_seeds_set(impl):
    """Code written against the seed iterates `DecodeManager.running_reqs` as requests (a set of
    Req there); kvledger keeps that, in admission order."""
    dm = impl.DecodeManager(page_size=4)
    ids = [1, 2, 3] if impl.__name__ == "kvledger.reference" else impl.requests.as_token_tensor([1, 2, 3])
    reqs = [
        impl.Req(
            ids,
            table_idx=i,
            cached_len=2,
            output_len=4,
            uid=uid,
            sampling_params=impl.SamplingParams(),
            cache_handle=None,
        )
        for i, uid in enumerate((7, 3, 5))
    ]
    dm.filter_reqs(reqs)
    assert list(dm.running_reqs) == reqs and all(r in dm.running_reqs for r in reqs)
    assert len(dm.running_reqs) == 3 and dm.running_reqs.get(3) is reqs[1]
    dm.remove_req(reqs[1])
    assert [r.uid for r in dm.running_reqs] == [7, 5] and reqs[1] not in dm.running_reqs
