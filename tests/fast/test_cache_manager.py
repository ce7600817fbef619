"""fast's CacheManager: its constructor's validation (and the reference's, the same contract), the
keyword-only `finished`, a one-token prefix hit copied into a fresh row, and page sizes that are not
powers of two against the reference in lockstep."""

# Mutation killers (`kvledger mutation`, properties/mutation.toml; results/mutation/README.md lists
# what survives): the lockstep run cannot see a mutant of code both sides share, of a check a correct
# run never trips, or of arithmetic that differs only on inputs the generators never draw (page sizes
# that are not powers of two, token ids above 256, uids that are not small ints). Each test here pins
# one of those down with numbers worked out by hand.

from __future__ import annotations

import pytest

from kvledger import fast, reference
from tests.support.ledger import live_scheduler


@pytest.mark.parametrize("impl", [reference, fast], ids=["reference", "fast"])
def test_cache_manager_validates_its_sizes_and_cache_type(impl):
    table = impl.make_page_table(1, 12)
    with pytest.raises(ValueError, match=r"^num_pages \(0\) and page_size \(4\) must be >= 1$"):
        impl.CacheManager(0, 4, table, "radix")
    with pytest.raises(ValueError, match=r"^num_pages \(3\) and page_size \(0\) must be >= 1$"):
        impl.CacheManager(3, 0, table, "radix")
    with pytest.raises(ValueError, match=r"^page_table width \(12\) must be a multiple of page_size \(5\): "):
        impl.CacheManager(3, 5, table, "radix")
    cm = impl.CacheManager(1, 1, table, "naive")
    assert list(cm.free_slots) == [0] and cm.available_size == 1
    impl.CacheManager(1, 3, impl.make_page_table(1, 6), "naive")  # one row
    for name in ("lru", "zzz", "Radix"):
        with pytest.raises(ValueError, match="^cache type must be 'naive' or 'radix', got"):
            impl.create_prefix_cache(name, 1)
    assert isinstance(impl.create_prefix_cache("".join(["nai", "ve"]), 2), impl.NaivePrefixCache)
    assert isinstance(impl.create_prefix_cache("".join(["rad", "ix"]), 2), impl.RadixPrefixCache)


def test_cache_manager_takes_finished_by_keyword_only():
    s, cm, reqs = live_scheduler(fast)
    with pytest.raises(TypeError):
        cm.cache_req(reqs[0], True)


def test_a_one_token_prefix_hit_is_copied_into_the_new_row():
    from kvledger.engine.ledger.trace import Header
    from kvledger.properties.lockstep import Lockstep

    lock = Lockstep(Header(num_pages=32, page_size=1, cache_type="radix", table_slots=4, max_seq_len=16))
    for op in [
        {"op": "submit", "uid": 8, "tokens": [1], "max_tokens": 8},  # holds page 0 throughout
        {"op": "submit", "uid": 0, "tokens": [5, 6, 7], "max_tokens": 4},
        {"op": "prefill", "budget": 64},
        {"op": "submit", "uid": 1, "tokens": [5, 9, 9], "max_tokens": 2},
        {"op": "probe", "tokens": [5, 9]},
        {"op": "prefill", "budget": 64},
    ]:  # uid 1 finds [5] cached: a fresh row, one page copied
        lock.apply(op)
    first = lock.ref.page_table[lock.ref.live[0].table_idx][0]
    assert first != 0 and lock.fast.page_table[lock.fast.live[1].table_idx][0].item() == first


def test_seeded_fuzz_cases_with_page_sizes_that_are_not_powers_of_two(monkeypatch):
    from kvledger.checker import lockstep_walk as fuzz
    from kvledger.properties.lockstep import Lockstep

    monkeypatch.setattr(fuzz, "PAGE_SIZES", (3, 5, 6))
    for case in range(4):  # both caches and both policies among them
        seed = fuzz.case_seed(15, 0, case)
        lock = Lockstep(fuzz.make_case(seed).header)
        assert lock.header.page_size in (3, 5, 6)
        for _ in fuzz.walk(seed, lock, lambda name: None, lambda: True, length=120):
            pass
