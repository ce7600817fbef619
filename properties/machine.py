"""Hypothesis state machine: random submit / prefill / decode / finish / abort / evict / probe
sequences applied to reference and fast in lockstep (see `lockstep.py`).

Requests draw tokens from a tiny alphabet over a few shared prefixes, so prefix hits, node
splits, two same-prefix requests prefilling together, eviction under pressure and
rejected-then-admitted requests all happen. Every operation is recorded; a failing run writes
its trace (see `trace.py`) to $KVLEDGER_FAILURES (default .kvledger/failures), so Hypothesis
failures replay and minimize like any other trace.

Both admission policies run (about half the examples each). Under `reserve` the rules and their
draws are what they always were, and no result ever names a preemption. Under `optimistic`
(reserve_ratio 0, 0.25 or 0.5; 0 most often) the pool holds at most OPTIMISTIC_POOL_TOKENS, and
`submit` clips a request until its worst case fits the pool (a bigger one is an InvalidOp under
optimistic). Rules only optimistic examples run push into preemption: `grow` decodes until a
step preempts, `chunk_then_grow` leaves a request mid-chunk first (then continues it), `stream`
has short same-prefix requests arrive one per step (several victims in one step), and `drain`
checks liveness: with no new requests, driving the scheduler as the engine does ends every
request within a bound counted from what is outstanding (operations, never time).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvledger.reference import events
from kvledger.reference.pages import div_ceil, tokens_to_finish

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
    # optimistic admission (the model's `preemption.py` and the cache scheduler's requeue)
    "preempt: running request", "preempt: mid-chunk", "preempt: a request of the step's own batch",
    "preempt: a request outside the step's batch", "preempt: several victims in one step",
    "preempt: the same request preempted twice", "preempt: re-prefill hits the prefix cache",
    "preempt: a preempted request aborted while waiting",
    "driver: every request of a step preempted", "driver: drain ended requests that were preempted",
})
# noted by rules of this machine alone (the fuzzer's walk has no drain)
MACHINE_ONLY_EVENTS = frozenset({"driver: drain ended requests that were preempted"})
REACHED: set = set()


def note(name: str) -> None:
    REACHED.add(name)
    event(name)
SAMPLE = st.lists(st.integers(0, 3), max_size=3)
BUDGETS = st.sampled_from([1, 2, 3, 5, 8, 16, 64, 1024])
# optimistic pools hold at most this many tokens (rounded down to whole pages, at least 2 pages):
# requests of a few dozen tokens then preempt one another on most examples
OPTIMISTIC_POOL_TOKENS = 24


def failures_dir() -> Path:
    return Path(os.environ.get("KVLEDGER_FAILURES", ".kvledger/failures"))


class LockstepMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 2, 4, 16]),
        num_pages=st.integers(8, 64),
        cache_type=st.sampled_from(["radix", "naive"]),
        table_slots=st.integers(1, 8),
        families=st.lists(st.lists(ALPHABET, min_size=1, max_size=40), min_size=1, max_size=3),
        admission=st.sampled_from(["reserve", "optimistic"]),
        reserve_ratio=st.sampled_from([0.0, 0.0, 0.25, 0.5]),  # 0 reserves least: most preemption
    )
    def setup(self, page_size: int, num_pages: int, cache_type: str, table_slots: int,
              families: List[List[int]], admission: str, reserve_ratio: float) -> None:
        events.set_listener(note)
        # `num_pages` is drawn as a pool size in tokens (8-64): the prompts are short, and
        # pools of 8-64 pages of 2-16 tokens almost never filled, so allocation never evicted
        # more than one page (the bug zoo's evict-counts-pages escaped the CI profile).
        if admission == "reserve":
            num_pages = max(3, num_pages // page_size)
            reserve_ratio = 0.5  # the header's default: reserve ignores it
        else:  # smaller still: preemption must be the common case, not the exception
            num_pages = max(2, min(num_pages, OPTIMISTIC_POOL_TOKENS) // page_size)
            table_slots += 2  # one request alone is never preempted; the pool, not the table, is the limit
        self.header = trace.Header(num_pages=num_pages, page_size=page_size, cache_type=cache_type,
                                   table_slots=table_slots, max_seq_len=256, admission=admission,
                                   reserve_ratio=reserve_ratio, producer="hypothesis")
        self.lock = Lockstep(self.header)
        self.families = families
        self.next_uid = 0
        self.rejected: set = set()
        self.preempted_seen = 0  # victims named by the results so far
        self.drained = False

    def teardown(self) -> None:
        events.set_listener(None)

    def _do(self, op: Dict) -> Dict:
        try:
            result = self.lock.apply(op)
        except Divergence:
            self._save()
            raise
        if op["op"] in ("prefill", "decode"):
            if not self.optimistic:
                self._check("preempted" not in result, f"a reserve {op['op']} result names preemptions: {result}")
            elif result["preempted"]:
                self.preempted_seen += len(result["preempted"])
                if not result["batch"]:
                    note("driver: every request of a step preempted")
        return result

    def _check(self, ok: bool, message: str) -> None:
        """A property of the run (not of one side): on failure, keep the trace like a divergence."""
        if not ok:
            self._save()
            raise AssertionError(message)

    @property
    def optimistic(self) -> bool:
        return self.header.policy.preempts

    @property
    def pool(self) -> int:
        return self.header.num_pages * self.header.page_size

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
        if self.optimistic:
            # At most half the pool of prompt (a shared prefix stays a prefix), so two requests
            # are admitted together and outgrow the pool as they decode; then the output is cut
            # until the worst case fits the pool (the submit is an InvalidOp otherwise).
            tokens = tokens[: max(1, self.pool // 2)]
            max_tokens = min(max_tokens, self.pool + 1 - len(tokens))
            assert tokens_to_finish(0, len(tokens) + max_tokens, self.header.page_size) <= self.pool
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

    @precondition(lambda self: self.optimistic and self.ref.dm.runnable)
    @rule(sample=SAMPLE, steps=st.integers(1, 16))
    def grow(self, sample: List[int], steps: int) -> None:
        """Optimistic only: decode until a step preempts (at most `steps` steps). Random rule
        choice rarely decodes often enough in a row to outgrow the pool; this does."""
        self._grow(sample, steps)

    def _grow(self, sample: List[int], steps: int) -> bool:
        """Decode until a step preempts (True) or `steps` steps ran or nothing runs (False)."""
        for _ in range(steps):
            if not self.ref.dm.runnable:
                return False
            if self._do({"op": "decode", "sample": sample})["preempted"]:
                return True
        return False

    @precondition(lambda self: self.optimistic and self.ref.dm.runnable and self.ref.waiting)
    @rule(budget=st.integers(1, 3), sample=SAMPLE, steps=st.integers(1, 16), fill=st.booleans())
    def chunk_then_grow(self, budget: int, sample: List[int], steps: int, fill: bool) -> None:
        """Optimistic only: admit a chunk of the next request, then decode the running ones
        until a step preempts (the request left mid-chunk is the newest, so it goes first) or,
        with `fill`, only while a decode still fits; then go on with the chunk. The decodes took
        pages admission had counted on for the rest of its prompt, so the continuation may not fit
        either: it preempts the request mid-chunk, and with it the whole step."""
        self.prefill(budget, sample)
        if fill:
            cm = self.ref.cm
            for _ in range(steps):
                if not self.ref.dm.runnable or cm.needed_size(list(self.ref.dm.running_reqs)) > cm.available_size:
                    break
                self.decode(sample)
        elif self._grow(sample, steps):
            return
        if self.ref.waiting:
            self.prefill(1024, sample)

    @precondition(lambda self: self.optimistic and not self.ref.waiting and not self.ref.live)
    @rule(family=st.integers(0, 2), keep=st.integers(1, 6),
          arrivals=st.lists(st.tuples(st.lists(ALPHABET, max_size=1), st.integers(1, 24)), min_size=3, max_size=6),
          sample=SAMPLE, steps=st.integers(1, 16))
    def stream(self, family: int, keep: int, arrivals: List, sample: List[int], steps: int) -> None:
        """Optimistic only, from idle: short requests over one shared prefix arrive one per step
        (submit, prefill, decode) until a step preempts; if none did, the running ones decode
        until one does. Admission (at ratio 0 it reserves only the prefill) fills the pool to the
        brim; the newest
        requests hold only a token or two of their own (the prefix is the cache's, locked by the
        older ones), so freeing one victim is often too little: a step preempts several."""
        for suffix, max_tokens in arrivals:
            self.submit(family, keep, suffix, max_tokens)
            if self._do({"op": "prefill", "budget": 1024, "sample": sample})["preempted"]:
                return
            if self.ref.dm.runnable and self._do({"op": "decode", "sample": sample})["preempted"]:
                return
        self._grow(sample, steps)

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

    @precondition(lambda self: self.optimistic and not self.drained and (self.ref.waiting or self.ref.live))
    @rule(budget=st.sampled_from([2, 5, 16, 1024]), sample=st.lists(ALPHABET, min_size=1, max_size=4))
    def drain(self, budget: int, sample: List[int]) -> None:
        """Liveness under optimistic admission: submit nothing more and drive the scheduler as the
        engine does (prefill if admission yields a batch, else decode); every request, waiting or
        live, ends within a bound counted from what is outstanding, however often it is preempted.
        Once per example: a drain is long, and the CI profile's time is bounded."""
        self.drained = True
        ref = self.ref
        requests = len({p.uid for p in ref.waiting} | set(ref.live))
        tokens = sum(r.max_device_len - r.device_len + 1 for r in ref.live.values()) + \
            sum(p.output_len + div_ceil(p.input_len, budget) for p in ref.waiting)
        bound = (requests + 1) * tokens + 10
        before, ops = self.preempted_seen, 0
        while ref.waiting or ref.live:
            self._check(ops < bound, f"liveness: {len(ref.waiting)} waiting and {len(ref.live)} live requests "
                                     f"still there after {ops} operations (bound {bound})")
            if ref.waiting:
                result = self._do({"op": "prefill", "budget": budget, "sample": sample})
                ops += 1
                if result["batch"] or result["preempted"]:
                    continue
            self._check(ref.dm.runnable, f"liveness: nothing admitted and nothing running; waiting "
                                         f"{[p.uid for p in ref.waiting]}, live {sorted(ref.live)}")
            self._do({"op": "decode", "sample": sample})
            ops += 1
        if self.preempted_seen > before:
            note("driver: drain ended requests that were preempted")

    @invariant()
    def preemptions_agree(self) -> None:
        if not hasattr(self, "lock"):
            return
        ref, fst = self.ref, self.lock.fast
        if not self.optimistic:
            self._check(ref.preemptions == fst.preemptions == 0, f"reserve preempted: reference "
                        f"{ref.preemptions}, fast {fst.preemptions}")
        else:
            self._check(ref.preemptions == fst.preemptions == self.preempted_seen,
                        f"preemptions: reference {ref.preemptions}, fast {fst.preemptions}, "
                        f"results named {self.preempted_seen}")
            self._check(ref.recomputed_tokens == fst.recomputed_tokens,
                        f"recomputed tokens: reference {ref.recomputed_tokens}, fast {fst.recomputed_tokens}")

    @invariant()
    def quiescent_when_idle(self) -> None:
        if hasattr(self, "lock") and not self.ref.live and not self.ref.waiting:
            note("driver: idle")


TestLockstep = LockstepMachine.TestCase
