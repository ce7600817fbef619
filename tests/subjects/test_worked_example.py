"""The worked adapter of docs/checking-your-cache-manager.md runs clean under the judge-mode fuzzer,
and the same fuzzer catches a one-line mistake in it (so the clean run is not a blind one)."""

from __future__ import annotations

import sys

from tests.support.paths import ROOT

sys.path.insert(0, str(ROOT / "docs" / "examples"))  # the worked adapter imports as the page shows
import my_cache_manager_subject  # noqa: E402

from kvledger.checker.subject_walk import run_case  # noqa: E402


def test_the_worked_adapter_keeps_every_invariant():
    findings = [run_case(my_cache_manager_subject.build, seed).finding for seed in range(40)]
    assert [f for f in findings if f is not None] == []


class ForgetsToUnlock(my_cache_manager_subject.MyCacheManagerSubject):
    def admit(self, uid, budget):  # a refusal that leaves the hit locked
        pending = self.pending[uid]
        handle = self.cm.match_req(pending).cuda_handle
        hit = super().admit(uid, budget)
        if hit is None:
            self.cm.lock(handle)
        return hit


def test_a_refusal_that_keeps_its_lock_is_caught():
    findings = [run_case(ForgetsToUnlock, seed).finding for seed in range(40)]
    assert "4-failed-admission" in {f.kind for f in findings if f is not None}
