"""`LockstepCore`: the lockstep machine's state and its plain rules over the reference and fast.

Each example builds a `Lockstep` pair of `CacheScheduler`s from a drawn header and applies every
operation to both (`_do`); the machine reads the reference's state to choose the next operation
(its waiting queue, running requests, live rows, prefix cache), as the judge-mode machine reads
the `SubjectDriver`'s queues instead: the reference is the model, so what it holds is the truth
the rules draw from. The rules that push optimistic admission into preemption and liveness are in
`optimistic_rules.py`, those about the radix cache's eviction order in `radix_order_rules.py`,
refused operations in `refusal_rules.py`; `machine.LockstepMachine` puts them together.
"""

from __future__ import annotations

from typing import Any, Dict, List, Set

from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from kvledger.engine.ledger import trace
from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.engine.ledger.divergence import state_diff
from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import OpResult
from kvledger.properties.eviction_order_watch import EvictionOrderWatch
from kvledger.properties.lockstep import Lockstep
from kvledger.properties.machine_base import DriverMachine, failures_dir
from kvledger.reference import events
from kvledger.reference.pages import tokens_to_finish

ALPHABET = st.integers(0, 3)

SAMPLE = st.lists(st.integers(0, 3), max_size=3)
BUDGETS = st.sampled_from([1, 2, 3, 5, 8, 16, 64, 1024])
# optimistic pools hold at most this many tokens (rounded down to whole pages, at least 2 pages):
# requests of a few dozen tokens then preempt one another on most examples
OPTIMISTIC_POOL_TOKENS = 24


class LockstepCore(DriverMachine):
    """The header, the lockstep pair and the counts every rule shares; submit, prefill, decode,
    evict and probe; the invariants of the run (finish and abort are `DriverMachine`'s)."""

    @initialize(
        page_size=st.sampled_from([1, 2, 4, 16]),
        num_pages=st.integers(8, 64),
        cache_type=st.sampled_from(["radix", "naive"]),
        table_slots=st.integers(1, 8),
        families=st.lists(st.lists(ALPHABET, min_size=1, max_size=40), min_size=1, max_size=3),
        admission=st.sampled_from(["reserve", "optimistic", "reserve", "adaptive"]),
        reserve_ratio=st.sampled_from([0.0, 0.0, 0.25, 0.5]),  # 0 reserves least: most preemption
    )
    def setup(
        self,
        page_size: int,
        num_pages: int,
        cache_type: str,
        table_slots: int,
        families: List[List[int]],
        admission: str,
        reserve_ratio: float,
    ) -> None:
        events.set_listener(self.note)
        # `num_pages` is drawn as a pool size in tokens (8-64): the prompts are short, and
        # pools of 8-64 pages of 2-16 tokens almost never filled, so allocation never evicted
        # more than one page (the bug zoo's evict-counts-pages escaped the CI profile).
        if admission == "reserve":
            num_pages = max(3, num_pages // page_size)
            reserve_ratio = 0.5  # the header's default: reserve ignores it
        else:  # smaller still: preemption must be the common case, not the exception
            num_pages = max(2, min(num_pages, OPTIMISTIC_POOL_TOKENS) // page_size)
            table_slots += 2  # one request alone is never preempted; the pool, not the table, is the limit
        self.header = trace.Header(
            num_pages=num_pages,
            page_size=page_size,
            cache_type=cache_type,
            table_slots=table_slots,
            max_seq_len=256,
            admission=admission,
            reserve_ratio=reserve_ratio,
            producer="hypothesis",
        )
        self.lock = Lockstep(self.header)
        self.progress.start_sequence()  # counted here, after the pair is built
        if cache_type == "radix":
            self.watch = EvictionOrderWatch(self.ref.cm.prefix_cache, self.note)
        self.families = families
        self.next_uid = 0
        self.rejected: Set[int] = set()
        self.preempted_seen = 0  # victims named by the results so far
        self.drained = False

    def teardown(self) -> None:
        events.set_listener(None)

    def _do(self, op: Dict[str, Any]) -> OpResult:
        try:
            result = self.lock.apply(op)
        except Finding as f:
            self._save(f)
            raise
        if op["op"] in ("prefill", "decode"):
            if not self.optimistic:
                self._check(result.preempted is None, f"a reserve {op['op']} result names preemptions: {result}")
            elif result.preempted:
                self.preempted_seen += len(result.preempted)
                if not result.batch:
                    self.note("driver: every request of a step preempted")
        return result

    def _check(self, ok: bool, message: str) -> None:
        """A property of the run (not of one side): on failure, keep the trace like a divergence."""
        if not ok:
            error = AssertionError(message)
            self._save(error)
            raise error

    @property
    def optimistic(self) -> bool:
        return self.header.policy.preempts

    @property
    def pool(self) -> int:
        return self.header.num_pages * self.header.page_size

    def _save(self, error: AssertionError) -> None:
        # Shrinking reruns failing sequences; Hypothesis replays the minimal one last, so the
        # file left behind (and the progress's last failure) is the shrunk failure.
        self.progress.last_failure = (self.header, list(self.lock.ops), error)
        failures_dir().mkdir(parents=True, exist_ok=True)
        (failures_dir() / "hypothesis-last-failure.jsonl").write_text(trace.dumps(self.header, self.lock.ops))

    @property
    def ref(self) -> CacheScheduler:
        return self.lock.ref

    def waiting_uids(self) -> List[int]:
        return [p.uid for p in self.ref.waiting]

    def running_uids(self) -> List[int]:
        uids: List[int] = self.ref.dm.running_reqs.uids()
        return uids

    def _before_abort(self, uid: int) -> None:
        if any(p.uid == uid and p.chunked_req is not None for p in self.ref.waiting):
            self.note("driver: abort mid-chunk")

    @rule(
        family=st.integers(0, 2),
        keep=st.integers(0, 48),
        suffix=st.lists(ALPHABET, max_size=12),
        max_tokens=st.integers(1, 24),
    )
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
        if self.rejected & set(result.batch or ()):
            self.note("driver: rejected request admitted later")
        if result.refused is not None:
            self.rejected.add(result.refused)
        if len(result.batch or ()) > 1:
            self.note("driver: several requests prefill together")

    @precondition(lambda self: self.ref.dm.runnable)
    @rule(sample=SAMPLE)
    def decode(self, sample: List[int]) -> None:
        self._do({"op": "decode", "sample": sample})

    @rule(fraction=st.floats(0.0, 1.0))
    def evict(self, fraction: float) -> None:
        """Evict that fraction of what is evictable, at least one token; with nothing evictable
        (the naive cache, everything locked), or a fraction of 0, evict 0 tokens (a valid no-op)."""
        evictable = self.ref.cm.prefix_cache.size_info.evictable_size
        self._do({"op": "evict", "tokens": max(1, int(evictable * fraction)) if evictable and fraction else 0})

    @rule(family=st.integers(0, 2), keep=st.integers(0, 48))
    def probe(self, family: int, keep: int) -> None:
        self._do({"op": "probe", "tokens": self.families[family % len(self.families)][:keep]})

    @invariant()
    def reference_and_fast_agree(self) -> None:
        """The whole observable state of both sides is the same (Lockstep.apply compares it after
        every operation too; here it is a property of the machine, shown as such when it fails)."""
        if not hasattr(self, "lock"):
            return
        ref, fst = self.lock.ref.snapshot(), self.lock.fast.snapshot()
        ref["runnable"], fst["runnable"] = self.lock.ref.dm.runnable, self.lock.fast.dm.runnable
        diff = state_diff(ref, fst)
        self._check(diff is None, f"reference and fast differ: {diff}")

    @invariant()
    def preemptions_agree(self) -> None:
        if not hasattr(self, "lock"):
            return
        ref, fst = self.ref, self.lock.fast
        if not self.optimistic:
            self._check(
                ref.preemptions == fst.preemptions == 0,
                f"reserve preempted: reference {ref.preemptions}, fast {fst.preemptions}",
            )
        else:
            self._check(
                ref.preemptions == fst.preemptions == self.preempted_seen,
                f"preemptions: reference {ref.preemptions}, fast {fst.preemptions}, "
                f"results named {self.preempted_seen}",
            )
            self._check(
                ref.recomputed_tokens == fst.recomputed_tokens,
                f"recomputed tokens: reference {ref.recomputed_tokens}, fast {fst.recomputed_tokens}",
            )

    @invariant()
    def quiescent_when_idle(self) -> None:
        if hasattr(self, "lock") and not self.ref.live and not self.ref.waiting:
            self.note("driver: idle")
