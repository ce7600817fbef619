"""Tests written to kill mutants that the mutation run's other stages let survive
(`kvledger mutation`, properties/mutation.toml; results/mutation/README.md lists what is left).

The lockstep run cannot see a mutant of code that both sides share (the cache scheduler), of a
check that a correct run never trips (the integrity checks, input validation), or of arithmetic
that only differs on inputs the generators never draw (page sizes that are not powers of two,
token ids above 256, uids that are not small ints). Each test here pins one of those down with
numbers worked out by hand. Counts and fixed inputs only: fast and deterministic.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from kvledger import fast, reference
from kvledger.engine.ledger.cache_scheduler import CacheScheduler, InvalidOp, InvariantViolation
from kvledger.reference.admission_policy import AdmissionPolicy
from kvledger.reference.cache_manager import IntegrityError
from tests.test_preemption_properties import NEWEST_PREEMPTED, noted  # noqa: F401 (noted: a fixture)

OPTIMISTIC = AdmissionPolicy("optimistic", 0.0)


def sched(impl=fast, *, num_pages=16, page_size=1, cache_type="radix", table_slots=4, max_seq_len=64, **kw):
    return CacheScheduler(impl, num_pages=num_pages, page_size=page_size, cache_type=cache_type,
                          table_slots=table_slots, max_seq_len=max_seq_len, **kw)


# -- the cache scheduler: operations refused, with the numbers in their messages -----------------
@pytest.mark.parametrize("impl", [reference, fast], ids=["reference", "fast"])
def test_submit_refuses_a_known_uid_and_says_so(impl):
    s = sched(impl)
    s.submit(3, [1, 2], 2)
    with pytest.raises(InvalidOp) as e:
        s.submit(3, [1, 2], 2)
    assert str(e.value) == "submit: uid 3 was already submitted"
    s.submit(2, [1], 1)  # not increasing: any new uid is welcome, a smaller one too
    assert s.known == {2, 3}


def test_increasing_uids_refuse_a_uid_not_above_the_last_and_remember_only_the_last():
    s = sched(increasing_uids=True)
    s.submit(5, [1], 1)
    for uid in (5, 4, 0):
        with pytest.raises(InvalidOp) as e:
            s.submit(uid, [1], 1)
        assert str(e.value) == f"submit: uid {uid} was already submitted (uids must increase; the last was 5)"
    s.submit(6, [1], 1)
    assert s.last_uid == 6 and s.known == set()


def test_submit_counts_prompt_and_output_against_max_seq_len():
    s = sched(max_seq_len=64)
    s.submit(0, [1] * 40, 24)  # 64 positions: exactly fits
    with pytest.raises(InvalidOp) as e:
        s.submit(1, [1] * 40, 30)
    assert str(e.value) == "submit: uid 1 needs 70 positions, max_seq_len is 64"
    with pytest.raises(InvalidOp) as e:
        s.submit(2, [1] * 3, 62)
    assert str(e.value) == "submit: uid 2 needs 65 positions, max_seq_len is 64"


def test_optimistic_submit_refuses_a_worst_case_larger_than_the_pool():
    s = sched(num_pages=4, page_size=4, admission=OPTIMISTIC)  # a pool of 16 tokens
    s.submit(0, [1] * 8, 9)  # 16 positions written at most: fits
    with pytest.raises(InvalidOp) as e:
        s.submit(1, [1] * 8, 10)
    assert str(e.value) == "submit: uid 1 may need 20 tokens of KV, the pool holds 16"


def test_a_request_the_implementation_refuses_is_an_invalid_op():
    s = sched()
    with pytest.raises(InvalidOp, match="^submit: request 7: input_ids is empty$"):
        s.submit(7, [], 3)
    assert 7 not in s.known and not s.waiting


def test_prefill_budget_must_be_positive():
    s = sched()
    s.submit(0, [1, 2], 1)
    with pytest.raises(InvalidOp, match="^prefill: budget must be >= 1, got 0$"):
        s.prefill(0)
    assert s.prefill(1)["batch"] == [0]  # a one-token chunk


def test_a_request_turned_away_by_an_exhausted_budget_is_not_a_rejection():
    s = sched()
    s.submit(0, [1, 2, 3], 2)
    s.submit(1, [4, 5, 6], 2)
    assert s.prefill(3) == {"batch": [0], "rejected": None}


def test_a_request_turned_away_for_want_of_a_table_slot_with_budget_left_is_a_rejection():
    s = sched(table_slots=1)
    s.submit(0, [1, 2, 3], 2)
    s.submit(1, [4, 5, 6], 2)
    assert s.prefill(4) == {"batch": [0], "rejected": 1}  # one token of budget left


def _leaky(kind):
    """An implementation whose admission turns a request away after touching the free list."""
    class Adder(fast.PrefillAdder):
        def try_add_one(self, pending):
            req = super().try_add_one(pending)
            if req is None and pending.uid == 1:
                cm = self.cache_manager
                if kind == "take":
                    cm.free_slots = cm.free_slots[:-1]  # the state reads smaller (a prefix of it)
                else:
                    cm.free_slots = torch.cat([cm.free_slots, cm.free_slots[-1:] + 1000])  # larger
            return req

    return types.SimpleNamespace(**{**vars(fast), "PrefillAdder": Adder})


@pytest.mark.parametrize("kind", ["take", "give"])
def test_a_rejection_that_changes_the_free_list_breaks_invariant_4(kind):
    s = sched(_leaky(kind), table_slots=1)
    s.submit(0, [1, 2, 3], 2)
    s.submit(1, [4, 5, 6], 2)
    with pytest.raises(InvariantViolation) as e:
        s.prefill(64)
    assert e.value.invariant == "4-failed-admission"


def test_without_check_admission_a_rejection_is_neither_checked_nor_reported():
    s = sched(_leaky("take"), table_slots=1, check_admission=False)  # the engine's setting
    s.submit(0, [1, 2, 3], 2)
    s.submit(1, [4, 5, 6], 2)
    assert s.prefill(64) == {"batch": [0], "rejected": None}


def test_abort_finds_a_uid_by_value_not_identity():
    s = sched()
    uid = int("100000")
    s.submit(uid, [1, 2], 2)
    assert s.abort(int("100000")) == {"where": "waiting"}
    s.submit(int("100001"), [1, 2], 2)
    s.prefill(64)
    assert s.abort(int("100001")) == {"where": "running"}


def test_evict_accepts_zero_to_everything_evictable():
    s = sched(page_size=2)
    s.submit(0, [1, 2, 3, 4, 5], 1)
    s.prefill(64)  # ends at once: its four whole-page prompt tokens go to the cache
    evictable = s.cm.prefix_cache.size_info.evictable_size
    assert evictable == 4
    assert s.evict(0) == {"evicted": []}
    for bad in (-1, 5):
        with pytest.raises(InvalidOp) as e:
            s.evict(bad)
        assert str(e.value) == f"evict: {bad} tokens asked, 4 evictable"
    assert sorted(s.evict(4)["evicted"]) == sorted(s.cm.page_table[0][:4].tolist())


def test_the_scheduler_takes_its_options_by_keyword_only_and_its_defaults():
    with pytest.raises(TypeError):
        CacheScheduler(fast, 16, 1, "radix", 4, 64)
    s = sched()
    assert s.increasing_uids is False and s.provenance is not None and s.observed_ratio is None
    assert sched(track_provenance=False).provenance is None


def test_an_adaptive_policy_built_at_run_time_is_adaptive():
    kind = "".join(["adap", "tive"])  # not the interned literal
    s = sched(admission=AdmissionPolicy(kind, 0.25))
    assert s.observed_ratio is not None and s.observed_ratio.initial == 0.25


def test_the_integrity_check_failure_is_the_partition_invariant(monkeypatch):
    s = sched()

    def broken(reqs):
        raise IntegrityError("integrity: planted")

    monkeypatch.setattr(s.cm, "check_integrity", broken)
    with pytest.raises(InvariantViolation) as e:
        s.check()
    assert e.value.invariant == "1-2-partition" and "planted" in str(e.value)


# -- preemption bookkeeping: recomputed tokens, where a victim waits, the rare-branch notes -------
def _drive(s, ops):
    return [s.apply(op) for op in ops]


PREEMPT_THEN_HIT = [  # uid 1 computes 5 positions, is preempted, and re-prefills hitting 3 of them
    {"op": "submit", "uid": 0, "tokens": [2, 2, 9], "max_tokens": 5},
    {"op": "submit", "uid": 1, "tokens": [2, 2, 2], "max_tokens": 5},
    {"op": "prefill", "budget": 64, "sample": [10, 20]},
    {"op": "decode", "sample": [11, 21]},
    {"op": "decode", "sample": [12, 22]},
    {"op": "decode", "sample": [13, 23]},  # preempts uid 1, which had computed [2, 2, 2, 20, 21]
    {"op": "decode", "sample": [14]},  # uid 0 ends
    {"op": "prefill", "budget": 64, "sample": [24]},
]


def test_recomputed_tokens_count_what_a_readmitted_victim_computes_again(noted):
    s = sched(reference, num_pages=8, max_seq_len=16, admission=OPTIMISTIC)
    results = _drive(s, PREEMPT_THEN_HIT)
    assert results[5]["preempted"] == [1] and s._preempted[1] == (0, 1)  # readmitted: nothing pending
    assert results[7]["batch"] == [1]
    assert s.recomputed_tokens == 2  # 5 computed, 3 found in the cache
    assert noted.count("preempt: re-prefill hits the prefix cache") == 1


def test_a_readmission_that_finds_nothing_cached_recomputes_everything(noted):
    s = sched(reference, num_pages=9, max_seq_len=16, admission=OPTIMISTIC)
    # uid 1 computes 4 positions and is preempted; uid 0 ends; then the cache lets go of everything
    _drive(s, NEWEST_PREEMPTED[:5] + [{"op": "evict", "tokens": 9}])
    assert s.recomputed_tokens == 0
    assert s.prefill(64, [22])["batch"] == [1]
    assert s.recomputed_tokens == 4
    assert "preempt: re-prefill hits the prefix cache" not in noted


def test_a_victim_waits_at_the_queue_head_before_requests_never_admitted():
    s = sched(reference, num_pages=9, max_seq_len=16, admission=OPTIMISTIC)
    _drive(s, [
        {"op": "submit", "uid": 0, "tokens": [1, 1, 1], "max_tokens": 3},
        {"op": "submit", "uid": 1, "tokens": [2, 2, 2], "max_tokens": 5},
        {"op": "prefill", "budget": 64, "sample": [10, 20]},
        {"op": "submit", "uid": 2, "tokens": [3, 3], "max_tokens": 2},
        {"op": "submit", "uid": 3, "tokens": [4, 4], "max_tokens": 2},
        {"op": "decode", "sample": [11, 21]},
    ])
    assert s.decode([12])["preempted"] == [1]
    assert [p.uid for p in s.waiting] == [1, 2, 3]


def test_the_second_preemption_of_a_request_is_noted_once_when_it_happens(noted):
    s = sched(reference, num_pages=6, cache_type="naive", max_seq_len=32, admission=OPTIMISTIC)
    s.submit(0, [1, 1], 2)
    s.submit(1, [2, 2], 5)
    s.submit(2, [3], 4)
    times, when = 0, []
    for _ in range(50):
        if not (s.waiting or s.live):
            break
        result = s.prefill(64, [5]) if s.waiting else None
        if not result or not (result["batch"] or result["preempted"]):
            result = s.decode([5])
        times += result["preempted"].count(2)
        when.append((times, noted.count("preempt: the same request preempted twice")))
    assert times == 2 and s.preemptions == 2
    assert [n for t, n in when if t == 1] and all(n == 0 for t, n in when if t < 2)
    assert all(n == 1 for t, n in when if t == 2)


class _OldestFirst(reference.Preemptor):
    def make_room(self, batch, live):
        victims = super().make_room(batch, live)
        return list(live)[: len(victims)]  # the oldest instead: the check must object


@pytest.mark.parametrize("uids", [(0, 1), (1, 0)], ids=["oldest-smaller", "oldest-larger"])
def test_victims_other_than_the_newest_break_invariant_6(uids):
    impl = types.SimpleNamespace(**{**vars(reference), "Preemptor": _OldestFirst})
    s = sched(impl, num_pages=9, max_seq_len=16, admission=OPTIMISTIC)
    s.submit(uids[0], [1, 1, 1], 3)
    s.submit(uids[1], [2, 2, 2], 5)
    s.prefill(64, [10, 20])
    s.decode([11, 21])
    with pytest.raises(InvariantViolation) as e:
        s.decode([12])
    assert e.value.invariant == "6-preemption-order"


# -- adaptive admission: the ratio follows what ended requests generated ------------------------
def _adaptive_run(finish_after):
    """Eight requests (prompt 3, max_tokens 4) end after generating finish_after[i] tokens."""
    s = sched(reference, num_pages=128, table_slots=16, admission=AdmissionPolicy("adaptive", 0.5))
    for uid in range(len(finish_after)):
        s.submit(uid, [uid % 3] * 4, 4)  # prompt 4: max_device_len 8, whose bits do not hold 4
    s.prefill(1024)
    for step in range(1, 5):
        for uid, n in enumerate(finish_after):
            if n == step and uid in s.live:
                assert s.policy.reserve_ratio == 0.5  # fewer than eight ended so far
                s.finish(uid)
        if s.dm.runnable:
            s.decode()
    return s


@pytest.mark.parametrize("finish_after,ratio", [([1] * 4 + [2] * 4, 0.375), ([3] * 4 + [4] * 4, 0.875)])
def test_the_adaptive_ratio_is_the_mean_fraction_of_max_tokens_generated(noted, finish_after, ratio):
    s = _adaptive_run(finish_after)
    assert not s.live and s.policy.reserve_ratio == ratio and s.dm.policy.reserve_ratio == ratio
    assert noted.count("adaptive: the reserve ratio changed") == 1
    s.submit(100, [7] * 2, 8)  # one more, at the mean already: the ratio stays, nothing is noted
    s.prefill(64)
    for _ in range(int(ratio * 8) - 1):
        s.decode()
    s.finish(100)
    assert s.policy.reserve_ratio == ratio and noted.count("adaptive: the reserve ratio changed") == 1
    s.forget_observed_outputs()
    assert s.policy.reserve_ratio == 0.5 and s.observed_ratio.ratio == 0.5


def test_forgetting_observed_outputs_is_a_no_op_without_adaptive_admission():
    s = sched(reference)
    s.forget_observed_outputs()
    assert s.observed_ratio is None and s.policy.kind == "reserve"


# -- what a step records ------------------------------------------------------------------------
def test_a_step_without_samples_appends_token_0():
    s = sched(reference)
    s.submit(0, [5, 6], 3)
    s.prefill(64)
    assert list(s.live[0].input_ids) == [5, 6, 0]


def test_the_snapshot_shows_whole_pages_of_rows_and_the_prompt_and_output_tokens():
    s = sched(fast, num_pages=8, page_size=4, max_seq_len=16)
    s.submit(0, [1, 2, 3, 4, 5], 3)
    s.prefill(64, [7])
    s.decode([8])
    snap = s.snapshot()
    req = s.live[0]
    assert (req.cached_len, req.device_len) == (6, 7)
    assert len(snap["rows"][0]) == 8  # two whole pages hold positions 0-5
    assert snap["token_pool"][0] == [1, 2, 3, 4, 5]  # the prompt: max_device_len - output_len


# -- fast's integrity check: each corruption found, and reported with the right numbers ----------
def _live(impl=fast):
    """A scheduler with a request live (10 prompt tokens, 2 whole pages cached by the radix cache
    and locked by it, its own third page) and 5 free pages of 4 tokens."""
    s = sched(impl, num_pages=8, page_size=4, max_seq_len=32)
    s.submit(0, list(range(1, 11)), 8)
    s.prefill(64, [50])
    return s, s.cm, list(s.live.values())


def test_integrity_reports_a_page_with_two_owners_with_its_counts():
    s, cm, reqs = _live(fast)
    cm.check_integrity(reqs)
    cached = cm.page_table[0][0].item()  # the request's first page: the cache holds it
    cm.free_slots = torch.cat([cm.free_slots, cm.free_slots.new_tensor([cached])])
    with pytest.raises(IntegrityError) as e:
        cm.check_integrity(reqs)
    page = cached // 4
    assert str(e.value) == (f"integrity: 1 pages without exactly one owner, e.g. page {page} (location {cached}) "
                            f"has 2 owners; free=6 cached=2 owned=1")


def test_integrity_reports_a_page_nobody_holds():
    s, cm, reqs = _live(fast)
    lost = cm.free_slots[0].item()
    cm.free_slots = cm.free_slots[1:]
    with pytest.raises(IntegrityError) as e:
        cm.check_integrity(reqs)
    assert str(e.value).startswith(f"integrity: 1 pages without exactly one owner, e.g. page {lost // 4} "
                                   f"(location {lost}) has 0 owners; free=4 cached=2 owned=1")


@pytest.mark.parametrize("page_size,bad", [(4, 13), (4, 32), (4, 36), (1, -1), (4, -4)])
def test_integrity_rejects_a_misaligned_or_outside_page_start(page_size, bad):
    s = sched(fast, num_pages=8, page_size=page_size, max_seq_len=32)
    cm = s.cm
    cm.free_slots = torch.cat([cm.free_slots[1:], cm.free_slots.new_tensor([bad])])
    with pytest.raises(IntegrityError, match="misaligned or outside the pool"):
        cm.check_integrity([])


def test_integrity_rejects_a_row_that_is_not_page_contiguous():
    s, cm, reqs = _live(fast)
    row = cm.page_table[0]
    assert row[9].item() == row[8].item() + 1
    row[9] += 1  # inside the request's own page, past what the cache holds
    with pytest.raises(IntegrityError, match="^integrity: request 0's row is not page-contiguous$"):
        cm.check_integrity(reqs)


def test_integrity_rejects_lock_counts_that_do_not_match_the_live_requests():
    s, cm, reqs = _live(fast)
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


# -- inputs the generators never draw: page sizes that are not powers of two, large token ids -----
def test_seeded_fuzz_cases_with_page_sizes_that_are_not_powers_of_two(monkeypatch):
    from kvledger.properties.lockstep import Lockstep
    from kvledger.tools import fuzz

    monkeypatch.setattr(fuzz, "PAGE_SIZES", (3, 5, 6))
    for case in range(4):  # both caches and both policies among them
        seed = fuzz.case_seed(15, 0, case)
        lock = Lockstep(fuzz.make_case(seed).header)
        assert lock.header.page_size in (3, 5, 6)
        for _ in fuzz.walk(seed, lock, lambda name: None, lambda: True, length=120):
            pass


def test_prefix_matching_compares_token_ids_by_value():
    from kvledger.properties.lockstep import Lockstep
    from kvledger.engine.ledger.trace import Header

    lock = Lockstep(Header(num_pages=32, page_size=1, cache_type="radix", table_slots=4, max_seq_len=16))
    big = [int(str(t)) for t in (50000, 50001, 50002, 50003)]
    lock.apply({"op": "submit", "uid": 0, "tokens": big, "max_tokens": 1})
    lock.apply({"op": "prefill", "budget": 64})
    probe = lock.apply({"op": "probe", "tokens": [50000, 50001, 7]})
    assert probe["cached_len"] == 2
    lock.apply({"op": "submit", "uid": 1, "tokens": [50000, 50001, 50002, 9, 9], "max_tokens": 1})
    lock.apply({"op": "prefill", "budget": 64})
    assert lock.fast.cm.prefix_cache.size_info.evictable_size == 6


# -- fast's constructors: validation, defaults, the cache type by name --------------------------
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
    s, cm, reqs = _live(fast)
    with pytest.raises(TypeError):
        cm.cache_req(reqs[0], True)


def test_fast_defaults_and_frozen_handles():
    assert fast.NaivePrefixCache().page_size == 1 and fast.RadixPrefixCache().page_size == 1
    assert fast.DecodeManager().page_size == 1
    handle = fast.CacheHandle(3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        handle.cached_len = 4


def test_naive_cache_evicts_nothing():
    cache = fast.NaivePrefixCache(2)
    assert len(cache.evict(0)) == 0 and len(cache.match_prefix(torch.tensor([1, 2, 3])).cuda_handle
                                              .get_matched_indices()) == 0
    with pytest.raises(RuntimeError, match="^cannot evict 1 tokens: the naive cache holds none$"):
        cache.evict(1)


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


def test_decode_manager_drops_requests_that_cannot_decode():
    s = sched(fast)
    s.submit(0, [1, 2], 1)  # ends with its first sampled token
    s.submit(1, [3, 4], 3)
    batch, _ = s.admit(64)
    for req in batch:
        req.complete_one()
        req.append_host(0)
    dm = fast.DecodeManager(1)
    dm.running_reqs.add(batch[0])  # it ended: filtering drops it
    dm.filter_reqs(batch[1:])
    assert dm.running_reqs.uids() == [1]


@pytest.mark.parametrize("page_size", [1, 2, 3, 4])
@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.25, 1 / 3, 0.5, 0.7, 0.999999, 1.0])
def test_fast_reserves_what_the_policy_says(page_size, ratio):
    from kvledger.fast.admission import _reserved_pages

    for kind in ("reserve", "optimistic"):
        policy = AdmissionPolicy("".join(kind), ratio)  # a kind built at run time, as a parsed one is
        for max_len in range(1, 14):
            for device_len in range(0, max_len + 1):
                for cached_len in range(0, max_len + 1):
                    want = policy.reserved_tokens(cached_len, device_len, max_len, page_size)
                    got = _reserved_pages(policy, cached_len, device_len, max_len, page_size) * page_size
                    assert got == want, (kind, ratio, cached_len, device_len, max_len, page_size)


def test_a_readmission_that_finds_everything_it_computed_recomputes_nothing():
    s = sched(reference, num_pages=9, max_seq_len=16, admission=OPTIMISTIC)
    results = _drive(s, NEWEST_PREEMPTED)  # uid 1 computes 4 positions, is preempted, re-prefills
    assert results[-1]["batch"] == [1] and s.recomputed_tokens == 0


def test_a_one_token_prefix_hit_is_copied_into_the_new_row():
    from kvledger.engine.ledger.trace import Header
    from kvledger.properties.lockstep import Lockstep

    lock = Lockstep(Header(num_pages=32, page_size=1, cache_type="radix", table_slots=4, max_seq_len=16))
    for op in [{"op": "submit", "uid": 8, "tokens": [1], "max_tokens": 8},  # holds page 0 throughout
               {"op": "submit", "uid": 0, "tokens": [5, 6, 7], "max_tokens": 4},
               {"op": "prefill", "budget": 64},
               {"op": "submit", "uid": 1, "tokens": [5, 9, 9], "max_tokens": 2},
               {"op": "probe", "tokens": [5, 9]},
               {"op": "prefill", "budget": 64}]:  # uid 1 finds [5] cached: a fresh row, one page copied
        lock.apply(op)
    first = lock.ref.page_table[lock.ref.live[0].table_idx][0]
    assert first != 0 and lock.fast.page_table[lock.fast.live[1].table_idx][0].item() == first


@pytest.mark.parametrize("impl", [reference, fast], ids=["reference", "fast"])
def test_preemption_never_takes_the_oldest_request(impl):
    s = sched(impl, num_pages=9, max_seq_len=16, admission=OPTIMISTIC)
    s.submit(0, [1, 1, 1], 4)
    s.submit(1, [2, 2, 2], 5)
    s.prefill(64, [10, 20])
    oldest, newest = s.live[0], s.live[1]
    oldest.device_len += 8  # a step for the oldest that no preemption can make room for
    with pytest.raises(RuntimeError, match="only the oldest request is left"):
        s.preemptor.make_room([oldest], [oldest, newest])
    assert oldest.table_idx not in s.tm.free_slots()  # the oldest kept its row


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


def test_prefixes_longer_than_256_tokens_match_whole():
    from kvledger.engine.ledger.trace import Header
    from kvledger.properties.lockstep import Lockstep

    lock = Lockstep(Header(num_pages=1024, page_size=1, cache_type="radix", table_slots=4, max_seq_len=700))
    prompt = [t % 7 for t in range(300)]
    lock.apply({"op": "submit", "uid": 0, "tokens": prompt, "max_tokens": 1})
    lock.apply({"op": "prefill", "budget": 1024})  # 300 tokens cached in one node
    assert lock.apply({"op": "probe", "tokens": prompt})["cached_len"] == 300
    lock.apply({"op": "submit", "uid": 1, "tokens": prompt + [1, 2, 3], "max_tokens": 1})
    lock.apply({"op": "prefill", "budget": 1024})
    lock.apply({"op": "submit", "uid": 2, "tokens": prompt + [1, 2, 3, 4, 5], "max_tokens": 2})
    assert lock.apply({"op": "probe", "tokens": prompt + [1, 2, 3, 4]})["cached_len"] == 303
    assert lock.apply({"op": "prefill", "budget": 1024})["batch"] == [2]
    assert lock.apply({"op": "probe", "tokens": prompt + [1, 2, 3, 4, 5]})["cached_len"] == 305
    lock.apply({"op": "submit", "uid": 3, "tokens": prompt, "max_tokens": 1})
    lock.apply({"op": "prefill", "budget": 1024})  # ends: inserts 300 tokens that are all cached already


# -- the reference model's own contracts: validation, defaults, its integrity check --------------
def test_reference_requests_validate_and_count():
    from kvledger.reference.requests import validate_pending

    params = reference.SamplingParams(max_tokens=3)
    req = reference.Req([1, 2, 3], 0, 1, 3, 7, params, reference.CacheHandle(0))
    assert (req.device_len, req.max_device_len, req.remain_len, req.extend_len) == (3, 6, 3, 2)
    assert req.can_decode
    for cached, ids, out in ((-1, [1, 2], 1), (2, [1, 2], 1), (3, [1, 2], 1), (0, [], 1), (0, [1, 2], -1)):
        with pytest.raises(ValueError, match=r"^request 7: need 0 <= cached_len"):
            reference.Req(ids, 0, cached, out, 7, params, reference.CacheHandle(0))
    done = reference.Req([1, 2], 0, 1, 0, 8, params, reference.CacheHandle(0))
    assert done.remain_len == 0 and not done.can_decode
    req.set_host_token(0, 9)
    req.set_host_token(2, 8)
    assert list(req.input_ids) == [9, 2, 8]
    for index in (-1, 3, 4):
        with pytest.raises(IndexError, match=rf"^request 7: token index {index} outside \[0, 3\)$"):
            req.set_host_token(index, 5)
    assert reference.Req([1, 2, 3, 4, 5], 0, 2, 1, 9, params, reference.CacheHandle(0)).extend_len == 3
    validate_pending(1, 1, reference.SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="input_ids is empty"):
        validate_pending(1, 0, params)
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        validate_pending(1, 1, reference.SamplingParams(max_tokens=0))
    a, b = (reference.PendingReq(1, [1], reference.SamplingParams()) for _ in range(2))
    assert a != b  # pending requests compare by identity


def test_sampling_params_defaults_and_greedy():
    p = reference.SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.ignore_eos, p.max_tokens) == (0.0, -1, 1.0, False, 1024)
    assert p.is_greedy is True
    greedy = {(0.0, -1, 1.0): True, (0.7, -1, 1.0): False, (0.7, 1, 1.0): True, (0.0, -1, 0.9): False,
              (-0.5, 5, 1.0): True, (0.7, 2, 1.0): False, (0.7, 0, 1.0): False, (0.0, 1, 1.5): False}
    for (t, k, top_p), want in greedy.items():
        assert reference.SamplingParams(temperature=t, top_k=k, top_p=top_p).is_greedy is want, (t, k, top_p)


def test_running_reqs_contain_requests_not_uids():
    from kvledger.reference.running_reqs import RunningReqs

    params = reference.SamplingParams(max_tokens=2)
    req = reference.Req([1, 2], 0, 0, 2, 4, params, reference.CacheHandle(0))
    twin = reference.Req([1, 2], 1, 0, 2, 4, params, reference.CacheHandle(0))
    running = RunningReqs()
    running.add(req)
    assert req in running and twin not in running and object() not in running


def test_reference_tables_validate_and_start_zeroed():
    with pytest.raises(ValueError, match=r"^max_running_reqs \(3\) exceeds page_table rows \(2\)$"):
        reference.TableManager(3, reference.make_page_table(2, 4))
    tm = reference.TableManager(1, reference.make_page_table(2, 4))
    assert tm.token_pool == [[0] * 4, [0] * 4] and tm.page_table == [[0] * 4, [0] * 4]
    assert reference.make_page_table(1, 2, "".join(["c", "pu"])) == [[0, 0]]
    for device in ("cuda", "aaa"):
        with pytest.raises(ValueError, match="the reference model lives on the host"):
            reference.make_page_table(1, 2, device)


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


def test_admission_policy_validation():
    for bad in (True, "0.5", -0.1, 1.5):
        with pytest.raises(ValueError, match=r"^reserve_ratio must be a number in \[0, 1\], got"):
            AdmissionPolicy("optimistic", bad)
    for ok in (0, 0.0, 1, 1.0):
        AdmissionPolicy("optimistic", ok)
    assert [AdmissionPolicy(k).preempts for k in ("reserve", "optimistic", "adaptive")] == [False, True, True]
    assert AdmissionPolicy("".join(["re", "serve"])).preempts is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        AdmissionPolicy().kind = "optimistic"


def test_observed_output_ratio_window_samples_and_clipping():
    from kvledger.reference.admission_policy import ObservedOutputRatio

    r = ObservedOutputRatio(0.5)
    for _ in range(7):
        assert r.observe(0, 4) == 0.5  # fewer than eight samples: the configured ratio
    assert r.observe(4, 4) == 0.125
    for _ in range(92):
        r.observe(0, 4)
    assert r.ratio == 0.01  # 100 samples, one of them 1.0
    for _ in range(7):
        r.observe(0, 4)
    assert r.ratio == 0.01  # the 1.0 was the 8th: still among the last 100
    r.observe(0, 4)
    assert r.ratio == 0.0  # the window keeps the last 100
    clip = ObservedOutputRatio(0.5, min_samples=1)
    assert clip.observe(9, 4) == 1.0 and clip.observe(-4, 4) == 0.5 and clip.observe(1, 4) == 5 / 12
    assert ObservedOutputRatio(0.3, window=2, min_samples=2).observe(3, 4) == 0.3


def test_reference_cache_manager_without_rows_and_finished_by_keyword():
    reference.CacheManager(1, 3, [], "naive")  # no rows: nothing to check
    s = sched(reference)
    s.submit(0, [1, 2], 2)
    s.prefill(64)
    with pytest.raises(TypeError):
        s.cm.cache_req(s.live[0], True)


def test_reference_integrity_reports_each_corruption():
    s, cm, reqs = _live(reference)
    cm.check_integrity(reqs)
    cm.free_slots.append(cm.free_slots[0])
    with pytest.raises(IntegrityError, match="^integrity: a page is in the free list twice$"):
        cm.check_integrity(reqs)
    cm.free_slots.pop()
    lost = cm.free_slots.pop(0)
    with pytest.raises(IntegrityError) as e:
        cm.check_integrity(reqs)
    assert str(e.value) == f"integrity: 1 pages without exactly one owner, e.g. page {lost // 4} " \
                           f"(location {lost}) owned by nobody"
    second = cm.free_slots.pop(0)
    with pytest.raises(IntegrityError) as e:
        cm.check_integrity(reqs)
    first = min(lost, second)
    assert str(e.value) == f"integrity: 2 pages without exactly one owner, e.g. page {first // 4} " \
                           f"(location {first}) owned by nobody"
    cm.free_slots[:0] = [lost, second]
    cached = cm.page_table[0][0]
    cm.free_slots.append(cached)
    with pytest.raises(IntegrityError) as e:
        cm.check_integrity(reqs)
    assert str(e.value).startswith(f"integrity: 1 pages without exactly one owner, e.g. page {cached // 4} "
                                   f"(location {cached}) owned by [")
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
    assert str(e.value) == (f"integrity: radix node {stray.cuda_handle.node.id} has lock count 1, "
                            f"but 0 live requests hold it")


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
        with pytest.raises(RuntimeError, match=f"radix sizes recount to evictable=4 protected=0, recorded {4 + delta} 0"):
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


# -- the rare-branch notes the model passes through (the evidence `kvledger check` reports) -------
def _notes_per_step(s, steps, noted):
    out = []
    for step in steps:
        before = len(noted)
        step(s)
        out.append(noted[before:])
    return out


def test_the_model_notes_each_branch_it_takes_on_a_scripted_preemption(noted):
    s = sched(reference, num_pages=8, max_seq_len=16, admission=OPTIMISTIC)
    per_op = _notes_per_step(s, [lambda s, op=op: s.apply(op) for op in PREEMPT_THEN_HIT], noted)
    lock_leaf, inserted = "radix: lock/unlock of an evictable leaf", "cache_req: new prefix inserted"
    assert per_op == [
        [], [],
        [inserted, lock_leaf, "radix: node split", "cache_req: duplicate prefix freed while running", inserted,
         lock_leaf],  # uid 0 caches [2, 2, 9]; uid 1 splits it at [2, 2] and frees its own copy of that
        [], [],
        ["preempt: running request", "preempt: a request of the step's own batch", inserted,
         "allocate: evicts from the prefix cache", "radix: eviction makes the parent an evictable leaf"],
        [inserted],  # uid 0 ends
        [lock_leaf, "admission: prefix hit", "preempt: re-prefill hits the prefix cache",
         "allocate: evicts from the prefix cache", "radix: eviction makes the parent an evictable leaf", inserted,
         lock_leaf],
    ]


def test_the_model_notes_partial_pages_rejections_and_a_second_preemption(noted):
    s = sched(reference, num_pages=6, cache_type="naive", max_seq_len=32, admission=OPTIMISTIC)
    s.submit(0, [1, 1], 2)
    s.submit(1, [2, 2], 5)
    s.submit(2, [3], 4)

    def step(s):
        result = s.prefill(64, [5]) if s.waiting else None
        if not result or not (result["batch"] or result["preempted"]):
            s.decode([5])

    per_op = _notes_per_step(s, [step] * 8, noted)
    preempted, tail = ["preempt: running request", "preempt: a request of the step's own batch"], \
        "cache_req: partial tail page freed"
    assert per_op == [[], preempted + [tail, tail], [], preempted + [tail, "preempt: the same request preempted twice"],
                      ["admission: rejected"], ["admission: rejected", tail], [], [tail]]
    assert not s.live and not s.waiting


# -- fast's own request and table bookkeeping (written again on purpose, so tested again) --------
def test_fast_token_tensors_are_one_dimensional():
    from kvledger.fast.requests import as_token_tensor

    assert as_token_tensor(torch.tensor([1, 2])).tolist() == [1, 2]
    for bad in (torch.tensor([[1, 2]]), torch.tensor(3)):
        with pytest.raises(ValueError, match="^input_ids must be 1-D, got shape"):
            as_token_tensor(bad)


def test_fast_requests_validate_count_and_bound_their_tokens():
    params = fast.SamplingParams(max_tokens=6)
    req = fast.Req([1, 2, 3, 4, 5], 0, 2, 6, 7, params, fast.CacheHandle(0))
    assert (req.device_len, req.max_device_len, req.remain_len, req.extend_len) == (5, 11, 6, 3)
    for cached, out in ((-1, 3), (5, 3), (6, 3), (0, -1)):
        with pytest.raises(ValueError) as e:
            fast.Req([1, 2, 3, 4, 5], 0, cached, out, 7, params, fast.CacheHandle(0))
        assert str(e.value) == (f"request 7: need 0 <= cached_len ({cached}) < device_len (5) "
                                f"<= max_device_len ({5 + out})")
    fast.Req([1, 2], 0, 0, 0, 8, params, fast.CacheHandle(0))  # no output left: valid
    req.set_host_token(0, 9)
    req.set_host_token(4, 8)
    assert req.input_ids.tolist() == [9, 2, 3, 4, 8]
    for index in (-1, 5, 6):  # 6: inside the buffer, past the tokens
        with pytest.raises(IndexError, match=rf"^request 7: token index {index} outside \[0, 5\)$"):
            req.set_host_token(index, 5)
    long = fast.Req(list(range(290)), 0, 0, 10, 9, params, fast.CacheHandle(0))
    for t in range(10):
        long.append_host(t)
    with pytest.raises(RuntimeError, match=r"^request 9: no room for another token \(300 max\)$"):
        long.append_host(0)
    a, b = (fast.PendingReq(1, [1], fast.SamplingParams()) for _ in range(2))
    assert a != b and a.input_len == 1 and a.output_len == 1024


def test_fast_table_slots_are_handed_out_once():
    with pytest.raises(ValueError, match=r"^max_running_reqs \(3\) exceeds page_table rows \(2\)$"):
        fast.TableManager(3, fast.make_page_table(2, 12))
    tm = fast.TableManager(1, fast.make_page_table(2, 12))
    assert tm.available_size == 1 and tm.free_slots() == [0]
    with pytest.raises(RuntimeError, match="^table slot 0 freed twice$"):
        tm.free(0)
    assert tm.allocate() == 0 and tm.available_size == 0
    with pytest.raises(RuntimeError, match="^no free table slot$"):
        tm.allocate()
    tm.free(0)
    with pytest.raises(RuntimeError, match="^table slot 0 freed twice$"):
        tm.free(0)
    assert tm.free_slots() == [0]


def test_reference_page_table_rows_keep_their_width_as_pages_are_allocated():
    s = sched(reference, num_pages=64, page_size=2, table_slots=2, max_seq_len=40)
    s.submit(0, [1, 2, 3], 30)
    s.prefill(64)
    for _ in range(28):  # one token short of the end: still live
        s.decode()
        assert [len(row) for row in s.page_table] == [40, 40]
    row = s.page_table[s.live[0].table_idx]
    assert all(row[p] == row[p - p % 2] + p % 2 for p in range(32))


def test_fast_radix_check_finds_a_value_longer_than_its_key():
    cache = fast.RadixPrefixCache(2)
    _, handle = cache.insert_prefix(torch.tensor([1, 2, 3, 4]), torch.tensor([8, 9, 10, 11], dtype=torch.int32))
    cache.check_integrity()
    node = handle.node
    node.value = torch.tensor([8, 9, 10, 11, 12, 13], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="key length 4"):
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
