"""Hypothesis state machine: random submit / prefill / decode / finish / abort / evict / probe
sequences applied to reference and fast in lockstep (see `lockstep.py`).

Requests draw tokens from a tiny alphabet over a few shared prefixes, so prefix hits, node
splits, two same-prefix requests prefilling together, eviction under pressure and
rejected-then-admitted requests all happen. Every operation is recorded; a failing run writes
its trace (see `trace.py`) to $KVLEDGER_FAILURES (default .kvledger/failures), so Hypothesis
failures replay and minimize like any other trace.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvledger.reference import events

from kvledger.engine import trace
from kvledger.properties.lockstep import Divergence, Lockstep

settings.register_profile(
    # derandomized (Hypothesis then keeps no example database); failures are kept as traces
    "ci", derandomize=True, max_examples=1500, stateful_step_count=60, deadline=None, print_blob=True,
)
settings.register_profile("deep", max_examples=5000, stateful_step_count=120, deadline=None)
settings.register_profile("dev", max_examples=40, stateful_step_count=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

ALPHABET = st.integers(0, 3)

# Rare branches the CI profile must reach (tests/test_lockstep_properties.py proves it).
EXPECTED_EVENTS = frozenset({
    "admission: prefix hit", "admission: rejected", "admission: rejected only after locking the hit",
    "admission: no table slot", "prefill: chunked", "radix: node split",
    "radix: one eviction takes several leaves", "radix: eviction makes the parent an evictable leaf",
    "allocate: evicts from the prefix cache", "cache_req: new prefix inserted",
    "cache_req: duplicate prefix freed while running", "cache_req: duplicate prefix freed at finish",
    "cache_req: partial tail page freed", "driver: rejected request admitted later",
    "driver: several requests prefill together", "driver: abort mid-chunk", "driver: idle",
})
REACHED: set = set()


def note(name: str) -> None:
    REACHED.add(name)
    event(name)
SAMPLE = st.lists(st.integers(0, 3), max_size=3)
BUDGETS = st.sampled_from([1, 2, 3, 5, 8, 16, 64, 1024])


def failures_dir() -> Path:
    return Path(os.environ.get("KVLEDGER_FAILURES", ".kvledger/failures"))


class LockstepMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 2, 4, 16]),
        num_pages=st.integers(8, 64),
        cache_type=st.sampled_from(["radix", "naive"]),
        table_slots=st.integers(1, 8),
        families=st.lists(st.lists(ALPHABET, min_size=1, max_size=40), min_size=1, max_size=3),
    )
    def setup(self, page_size: int, num_pages: int, cache_type: str, table_slots: int,
              families: List[List[int]]) -> None:
        events.set_listener(note)
        # `num_pages` is drawn as a pool size in tokens (8-64): the prompts are short, and
        # pools of 8-64 pages of 2-16 tokens almost never filled, so allocation never evicted
        # more than one page (the bug zoo's evict-counts-pages escaped the CI profile).
        num_pages = max(3, num_pages // page_size)
        self.header = trace.Header(num_pages=num_pages, page_size=page_size, cache_type=cache_type,
                                   table_slots=table_slots, max_seq_len=256, producer="hypothesis")
        self.lock = Lockstep(self.header)
        self.families = families
        self.next_uid = 0
        self.rejected: set = set()

    def teardown(self) -> None:
        events.set_listener(None)

    def _do(self, op: Dict) -> Dict:
        try:
            return self.lock.apply(op)
        except Divergence:
            self._save()
            raise

    def _save(self) -> None:
        # Shrinking reruns failing sequences; Hypothesis replays the minimal one last, so the
        # file left behind is the shrunk failure.
        failures_dir().mkdir(parents=True, exist_ok=True)
        (failures_dir() / "hypothesis-last-failure.jsonl").write_text(trace.dumps(self.header, self.lock.ops))

    @property
    def ref(self):
        return self.lock.ref

    @rule(family=st.integers(0, 2), keep=st.integers(0, 48), suffix=st.lists(ALPHABET, max_size=12),
          max_tokens=st.integers(1, 24))
    def submit(self, family: int, keep: int, suffix: List[int], max_tokens: int) -> None:
        tokens = self.families[family % len(self.families)][:keep] + suffix
        if not tokens:
            tokens = [0]
        max_tokens = min(max_tokens, self.header.max_seq_len - len(tokens))
        self._do({"op": "submit", "uid": self.next_uid, "tokens": tokens, "max_tokens": max_tokens})
        self.next_uid += 1

    @precondition(lambda self: self.ref.waiting)
    @rule(budget=BUDGETS, sample=SAMPLE)
    def prefill(self, budget: int, sample: List[int]) -> None:
        result = self._do({"op": "prefill", "budget": budget, "sample": sample})
        if self.rejected & set(result["batch"]):
            note("driver: rejected request admitted later")
        if result["rejected"] is not None:
            self.rejected.add(result["rejected"])
        if len(result["batch"]) > 1:
            note("driver: several requests prefill together")

    @precondition(lambda self: self.ref.dm.runnable)
    @rule(sample=SAMPLE)
    def decode(self, sample: List[int]) -> None:
        self._do({"op": "decode", "sample": sample})

    @precondition(lambda self: self.ref.dm.runnable)
    @rule(pick=st.integers(0, 63))
    def finish(self, pick: int) -> None:
        uids = self.ref.dm.running_reqs.uids()
        self._do({"op": "finish", "uid": uids[pick % len(uids)]})

    @precondition(lambda self: self.ref.waiting or self.ref.dm.runnable)
    @rule(pick=st.integers(0, 63))
    def abort(self, pick: int) -> None:
        uids = [p.uid for p in self.ref.waiting] + self.ref.dm.running_reqs.uids()
        uid = uids[pick % len(uids)]
        if any(p.uid == uid and p.chunked_req is not None for p in self.ref.waiting):
            note("driver: abort mid-chunk")
        self._do({"op": "abort", "uid": uid})

    @precondition(lambda self: self.ref.cm.prefix_cache.size_info.evictable_size > 0)
    @rule(fraction=st.floats(0.0, 1.0))
    def evict(self, fraction: float) -> None:
        evictable = self.ref.cm.prefix_cache.size_info.evictable_size
        self._do({"op": "evict", "tokens": max(1, int(evictable * fraction))})

    @rule(family=st.integers(0, 2), keep=st.integers(0, 48))
    def probe(self, family: int, keep: int) -> None:
        self._do({"op": "probe", "tokens": self.families[family % len(self.families)][:keep]})

    @invariant()
    def quiescent_when_idle(self) -> None:
        if hasattr(self, "lock") and not self.ref.live and not self.ref.waiting:
            note("driver: idle")


TestLockstep = LockstepMachine.TestCase
