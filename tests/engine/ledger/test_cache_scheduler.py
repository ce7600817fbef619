"""The cache scheduler (engine/ledger/cache_scheduler.py) on hand-worked cases: the operations it
refuses, with the numbers in their messages; when a request turned away is a rejection; invariant 4
around a rejection; abort, evict and the options; adaptive admission's ratio; what a step records.

These were written to kill mutants that the mutation run's other stages let survive (`kvledger
mutation`, properties/mutation.toml; results/mutation/README.md lists what is left). The lockstep
run cannot see a mutant of code that both sides share (the cache scheduler), of a check that a
correct run never trips (the integrity checks, input validation), or of arithmetic that only differs
on inputs the generators never draw (page sizes that are not powers of two, token ids above 256,
uids that are not small ints). Each test here pins one of those down with numbers worked out by
hand; the killers of fast's and the reference's own code sit with their tests in tests/fast and
tests/reference. Counts and fixed inputs only: fast and deterministic.
"""

from __future__ import annotations

import types

import pytest
import torch

from kvledger import fast, reference
from kvledger.engine.ledger.cache_scheduler import CacheScheduler, InvalidOp, InvariantViolation
from kvledger.engine.ledger.ops import OpResult
from kvledger.reference.admission_policy import AdmissionPolicy
from kvledger.reference.cache_manager import IntegrityError
from tests.support.ledger import OPTIMISTIC, sched


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
    assert s.prefill(1).batch == (0,)  # a one-token chunk


def test_a_request_turned_away_by_an_exhausted_budget_is_not_a_rejection():
    s = sched()
    s.submit(0, [1, 2, 3], 2)
    s.submit(1, [4, 5, 6], 2)
    assert s.prefill(3) == OpResult(batch=(0,), refused=None)


def test_a_request_turned_away_for_want_of_a_table_slot_with_budget_left_is_a_rejection():
    s = sched(table_slots=1)
    s.submit(0, [1, 2, 3], 2)
    s.submit(1, [4, 5, 6], 2)
    assert s.prefill(4) == OpResult(batch=(0,), refused=1)  # one token of budget left


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
    assert s.prefill(64) == OpResult(batch=(0,), refused=None)


def test_abort_finds_a_uid_by_value_not_identity():
    s = sched()
    uid = int("100000")
    s.submit(uid, [1, 2], 2)
    assert s.abort(int("100000")) == OpResult(where="waiting")
    s.submit(int("100001"), [1, 2], 2)
    s.prefill(64)
    assert s.abort(int("100001")) == OpResult(where="running")


def test_evict_accepts_zero_to_everything_evictable():
    s = sched(page_size=2)
    s.submit(0, [1, 2, 3, 4, 5], 1)
    s.prefill(64)  # ends at once: its four whole-page prompt tokens go to the cache
    evictable = s.cm.prefix_cache.size_info.evictable_size
    assert evictable == 4
    assert s.evict(0) == OpResult(evicted=())
    for bad in (-1, 5):
        with pytest.raises(InvalidOp) as e:
            s.evict(bad)
        assert str(e.value) == f"evict: {bad} tokens asked, 4 evictable"
    assert sorted(s.evict(4).evicted or ()) == sorted(s.cm.page_table[0][:4].tolist())


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
