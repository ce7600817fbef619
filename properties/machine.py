"""Hypothesis state machine: random submit / prefill / decode / finish / abort / evict / probe
sequences applied to reference and fast in lockstep (see `lockstep.py`).

Requests draw tokens from a tiny alphabet over a few shared prefixes, so prefix hits, node
splits, two same-prefix requests prefilling together, eviction under pressure and
rejected-then-admitted requests all happen. Every operation is recorded; a failing run writes
its trace (see `trace.py`) to $KVLEDGER_FAILURES (default .kvledger/failures), so Hypothesis
failures replay and minimize like any other trace.

Every admission policy runs: `reserve` about half the examples, `optimistic` and `adaptive` (the
ratio follows what ended requests generated) a quarter each. Under `reserve` no result ever names a
preemption. Under the other two (reserve_ratio 0, 0.25 or 0.5 to start; 0 most often) the pool
holds at most OPTIMISTIC_POOL_TOKENS, and `submit` clips a request until its worst case fits the
pool (a bigger one is an InvalidOp there). Rules only those examples run push into preemption: `grow` decodes until a
step preempts, `chunk_then_grow` leaves a request mid-chunk first (then continues it),
`outgrown_chunk` does so from idle, where the continuation's step loses its whole batch, `stream`
has short same-prefix requests arrive one per step (several victims in one step), and `drain`
checks liveness: with no new requests, driving the scheduler as the engine does ends every
request within a bound counted from what is outstanding (operations, never time).

`burst` has short requests over related prompts end at their prefill together, the states where
the radix cache's eviction order depends on its bookkeeping (see `EvictionOrderWatch`), and
`invalid` checks that an operation the scheduler must refuse is refused on both sides and changes
nothing. Hypothesis already runs swarm testing over the rules (each example enables a random
subset), so a rule's share varies from example to example.

The Hypothesis profiles (ci, deep, dev) are in `profiles.py`, registered by whoever runs the
machine (tests/conftest.py, the tools), never by importing this module.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvledger.engine.ledger import trace
from kvledger.engine.ledger.divergence import state_diff
from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import InvalidOp, OpResult
from kvledger.properties.lockstep import Lockstep
from kvledger.reference import events
from kvledger.reference.pages import div_ceil, tokens_to_finish

ALPHABET = st.integers(0, 3)

# Rare branches the CI profile must reach (tests/properties/test_lockstep_machine.py proves it).
EXPECTED_EVENTS = frozenset(
    {
        "admission: prefix hit",
        "admission: rejected",
        "admission: rejected only after locking the hit",
        "admission: no table slot",
        "prefill: chunked",
        "radix: node split",
        "radix: one eviction takes several leaves",
        "radix: eviction makes the parent an evictable leaf",
        "allocate: evicts from the prefix cache",
        "cache_req: new prefix inserted",
        "cache_req: duplicate prefix freed while running",
        "cache_req: duplicate prefix freed at finish",
        "cache_req: partial tail page freed",
        "driver: rejected request admitted later",
        "driver: several requests prefill together",
        "driver: abort mid-chunk",
        "driver: idle",
        # optimistic admission (the model's `preemption.py` and the cache scheduler's requeue)
        "preempt: running request",
        "preempt: mid-chunk",
        "preempt: a request of the step's own batch",
        "preempt: a request outside the step's batch",
        "preempt: several victims in one step",
        "preempt: the same request preempted twice",
        "preempt: re-prefill hits the prefix cache",
        "preempt: a preempted request aborted while waiting",
        "driver: every request of a step preempted",
        "driver: drain ended requests that were preempted",
        "adaptive: the reserve ratio changed",
        # the order of eviction (fast keeps its evictable leaves in a heap, see EvictionOrderWatch)
        "radix: eviction after a cached leaf was re-touched",
        "radix: eviction after a leaf gained a child",
        "radix: lock/unlock of an evictable leaf",
    }
)
# noted by this machine alone: the fuzzer's walk has no drain, and no EvictionOrderWatch
MACHINE_ONLY_EVENTS = frozenset(
    {
        "driver: drain ended requests that were preempted",
        "radix: eviction after a cached leaf was re-touched",
        "radix: eviction after a leaf gained a child",
    }
)
REACHED: set = set()
# name -> the number of the sequence (1 = the first the run generated) that first reached it
FIRST_REACHED: Dict[str, int] = {}
SEQUENCES = [0]  # sequences started so far (a list: `setup` counts in place)


def note(name: str) -> None:
    REACHED.add(name)
    FIRST_REACHED.setdefault(name, SEQUENCES[0])
    event(name)


def reset_reached() -> None:
    """Forget what earlier runs in this process reached (before a run that reports it)."""
    REACHED.clear()
    FIRST_REACHED.clear()
    SEQUENCES[0] = 0


class EvictionOrderWatch:
    """Two states of the reference tree that only an eviction order can show, noted as events.

    fast keeps its evictable leaves in a heap whose entries carry the key (last_access, id) they
    had when pushed; each change of a leaf must push it again (`_changed`). The reference has no
    heap, so this wraps its radix cache (this instance only; nothing of its behaviour changes) and
    notes, at each eviction, whether a heap that missed one kind of refresh would order it wrong:

    - a walk stamped an evictable leaf (an admission that matched it and was turned away before
      locking it, or a finished request's insert over a duplicate), no lock has covered it since,
      and its old stamp would order it before another evictable leaf its new stamp comes after;
    - an evictable leaf gained a child on insert and nothing touched or locked it since, so a heap
      that kept its entry would hold a node that is no longer a leaf.
    """

    def __init__(self, cache, note=note) -> None:
        self.cache, self.note = cache, note
        self.retouched: Dict[object, int] = {}  # evictable leaf -> its stamp before the first re-touch
        self.gained: Dict[object, int] = {}  # leaf that gained a child -> its stamp then
        self._walked: tuple | None = None  # (end node of the last walk, whether it was an evictable leaf)
        walk, insert, lock, evict = cache._walk, cache.insert_prefix, cache.lock_handle, cache.evict

        def watched_walk(ids):
            stamps = {n: n.last_access for n in self._evictable_leaves()}
            node, matched = walk(ids)
            self._walked = (node, node in stamps)
            if node in stamps and node.last_access != stamps[node]:
                self.retouched.setdefault(node, stamps[node])
            return node, matched

        def watched_insert(input_ids, indices):
            result = insert(input_ids, indices)
            node, was_leaf = self._walked
            if was_leaf and node.children:
                self.gained[node] = node.last_access
            return result

        def watched_lock(handle, unlock=False):
            node = handle.node
            while node is not None and node.parent is not None:  # a lock or unlock re-keys the path
                self.retouched.pop(node, None)
                self.gained.pop(node, None)
                node = node.parent
            return lock(handle, unlock)

        def watched_evict(size):
            self._before_eviction()
            return evict(size)

        cache._walk, cache.insert_prefix, cache.lock_handle, cache.evict = (
            watched_walk,
            watched_insert,
            watched_lock,
            watched_evict,
        )

    def _in_tree(self, node) -> bool:
        return node.parent is not None and node.parent.children.get(self.cache._edge(node.key)) is node

    def _evictable_leaves(self) -> set:
        return {n for n in self.cache.nodes() if n.ref_count == 0 and n.is_leaf()}

    def _before_eviction(self) -> None:
        leaves = self._evictable_leaves()
        self.retouched = {n: t for n, t in self.retouched.items() if n in leaves}
        if any(
            (t, n.id) < (m.last_access, m.id) < (n.last_access, n.id) for n, t in self.retouched.items() for m in leaves
        ):
            self.note("radix: eviction after a cached leaf was re-touched")
        self.gained = {n: t for n, t in self.gained.items() if self._in_tree(n) and n.children and n.last_access == t}
        if self.gained:
            self.note("radix: eviction after a leaf gained a child")


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
        SEQUENCES[0] += 1
        if cache_type == "radix":
            self.watch = EvictionOrderWatch(self.ref.cm.prefix_cache)
        self.families = families
        self.next_uid = 0
        self.rejected: set = set()
        self.preempted_seen = 0  # victims named by the results so far
        self.drained = False

    def teardown(self) -> None:
        events.set_listener(None)

    def _do(self, op: Dict) -> OpResult:
        try:
            result = self.lock.apply(op)
        except Finding:
            self._save()
            raise
        if op["op"] in ("prefill", "decode"):
            if not self.optimistic:
                self._check(result.preempted is None, f"a reserve {op['op']} result names preemptions: {result}")
            elif result.preempted:
                self.preempted_seen += len(result.preempted)
                if not result.batch:
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
            note("driver: rejected request admitted later")
        if result.refused is not None:
            self.rejected.add(result.refused)
        if len(result.batch or ()) > 1:
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
            if self._do({"op": "decode", "sample": sample}).preempted:
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
    @rule(family=st.integers(0, 2), sample=SAMPLE)
    def outgrown_chunk(self, family: int, sample: List[int]) -> None:
        """Optimistic only, from idle: a one-token request that may grow to the whole pool runs,
        then chunk_then_grow admits a half-pool prompt one token at a time and decodes the first
        while a decode fits. The chunk's continuation no longer fits: its step preempts the request
        mid-chunk, the whole batch. From an arbitrary state the half-pool prompt is mostly turned
        away instead, and no step loses its whole batch."""
        self.submit(family, 1, [], self.pool)
        self._do({"op": "prefill", "budget": 1024, "sample": sample})
        self.submit(family, self.pool, [0] * self.pool, 1)
        self.chunk_then_grow(1, sample, self.pool, True)

    @precondition(lambda self: self.optimistic and not self.ref.waiting and not self.ref.live)
    @rule(
        family=st.integers(0, 2),
        keep=st.integers(1, 6),
        arrivals=st.lists(st.tuples(st.lists(ALPHABET, max_size=1), st.integers(1, 24)), min_size=3, max_size=6),
        sample=SAMPLE,
        steps=st.integers(1, 16),
    )
    def stream(self, family: int, keep: int, arrivals: List, sample: List[int], steps: int) -> None:
        """Optimistic only, from idle: short requests over one shared prefix arrive one per step
        (submit, prefill, decode) until a step preempts; if none did, the running ones decode
        until one does. Admission (at ratio 0 it reserves only the prefill) fills the pool to the
        brim; the newest
        requests hold only a token or two of their own (the prefix is the cache's, locked by the
        older ones), so freeing one victim is often too little: a step preempts several."""
        for suffix, max_tokens in arrivals:
            self.submit(family, keep, suffix, max_tokens)
            if self._do({"op": "prefill", "budget": 1024, "sample": sample}).preempted:
                return
            if self.ref.dm.runnable and self._do({"op": "decode", "sample": sample}).preempted:
                return
        self._grow(sample, steps)

    @precondition(lambda self: self.ref.dm.runnable)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        uid = data.draw(st.sampled_from(self.ref.dm.running_reqs.uids()), label="uid")
        self._do({"op": "finish", "uid": uid})

    @precondition(lambda self: self.ref.waiting or self.ref.dm.runnable)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        uids = [p.uid for p in self.ref.waiting] + self.ref.dm.running_reqs.uids()
        uid = data.draw(st.sampled_from(uids), label="uid")
        if any(p.uid == uid and p.chunked_req is not None for p in self.ref.waiting):
            note("driver: abort mid-chunk")
        self._do({"op": "abort", "uid": uid})

    @rule(fraction=st.floats(0.0, 1.0))
    def evict(self, fraction: float) -> None:
        """Evict that fraction of what is evictable, at least one token; with nothing evictable
        (the naive cache, everything locked), or a fraction of 0, evict 0 tokens (a valid no-op)."""
        evictable = self.ref.cm.prefix_cache.size_info.evictable_size
        self._do({"op": "evict", "tokens": max(1, int(evictable * fraction)) if evictable and fraction else 0})

    @precondition(lambda self: self.header.cache_type == "radix" and not self.ref.waiting)
    @rule(
        family=st.integers(0, 2),
        tail=st.lists(ALPHABET, max_size=8),
        arrivals=st.lists(st.tuples(st.integers(0, 1), st.sampled_from([0, 1, 2, 4, 8])), min_size=2, max_size=4),
        again=st.booleans(),
        evict=st.none() | st.floats(0.0, 1.0),
    )
    def burst(self, family: int, tail: List[int], arrivals: List, again: bool, evict: float | None) -> None:
        """Short requests (one output token: they end at their prefill) arrive together and prefill
        in one batch; then, maybe, an eviction. Each prompt is the family's start, a branch token
        (0 or 1) and the first `cut` tokens of `tail`: prompts on one branch are prefixes of one
        another, the two branches are separate leaves; with `again` the first request arrives
        once more at the end (a retry). In one batch a request's insert comes after those ahead
        of it, which ended and unlocked theirs: it extends an evictable leaf (the leaf gains a
        child), or stamps again a leaf older than one cached since (a repeated prompt), and the
        eviction's order shows whether the prefix cache re-keyed those leaves."""
        arrivals = arrivals + arrivals[:1] * again
        fam = self.families[family % len(self.families)]
        share = max(1, self.pool // len(arrivals) - self.header.page_size)  # so that most of them fit
        keep = min(len(fam), share // 2)
        for branch, cut in arrivals:
            self.submit(family, keep, ([branch] + tail[:cut])[: share - keep], 1)
        self._do({"op": "prefill", "budget": 1024, "sample": [0]})
        if evict is not None:
            self.evict(max(evict, 1e-9))

    def _invalid_ops(self) -> List[Dict]:
        """Operations the scheduler must refuse in this state, leaving it as it was."""
        ops = [
            {"op": "submit", "uid": self.next_uid, "tokens": [0] * self.header.max_seq_len, "max_tokens": 1},
            {"op": "submit", "uid": self.next_uid, "tokens": [], "max_tokens": 1},
            {"op": "submit", "uid": self.next_uid, "tokens": [0], "max_tokens": 0},
            {"op": "prefill", "budget": 0, "sample": []},
            {"op": "finish", "uid": self.next_uid},
            {"op": "abort", "uid": self.next_uid},
            {"op": "evict", "tokens": self.ref.cm.prefix_cache.size_info.evictable_size + 1},
            {"op": "evict", "tokens": -1},
            {"op": "probe"},
            {"op": "no-such-op"},
        ]
        if self.next_uid:
            ops.append({"op": "submit", "uid": self.next_uid - 1, "tokens": [0], "max_tokens": 1})
        if self.optimistic:  # its worst case is bigger than the pool: preemption could never fit it
            ops.append({"op": "submit", "uid": self.next_uid, "tokens": [0] * (self.pool + 1), "max_tokens": 1})
        if self.ref.waiting:
            ops.append({"op": "finish", "uid": self.ref.waiting[0].uid})
        # a stop may name only a request of the step that samples: on an empty step, none
        ops.append({"op": "decode", "sample": [], "stop": [self.next_uid]})
        ops.append({"op": "prefill", "budget": 1024, "sample": [], "stop": [self.next_uid]})
        running = self.ref.dm.running_reqs.uids()
        if running:
            ops.append({"op": "decode", "sample": [], "stop": running[:1] * 2})
            ops.append({"op": "prefill", "budget": 1024, "sample": [], "stop": running[:1]})
        # waiting requests that will not sample, known only once admission ran (and rolled back):
        # behind the head, a budget of 1 admits nobody; a head mid-chunk with 2 tokens to go stays so
        waiting = self.ref.waiting
        if len(waiting) > 1:
            ops.append({"op": "prefill", "budget": 1, "sample": [], "stop": [waiting[-1].uid]})
        if (
            waiting
            and waiting[0].chunked_req is not None
            and waiting[0].input_len - waiting[0].chunked_req.cached_len > 1
        ):
            ops.append({"op": "prefill", "budget": 1, "sample": [], "stop": [waiting[0].uid]})
        return ops

    @rule(data=st.data())
    def invalid(self, data: st.DataObject) -> None:
        """An operation the scheduler must refuse (InvalidOp), on both sides, changing nothing
        (the trace keeps only valid operations, so a refusal that changed state would not replay).
        Among them a prefill whose `stop` names a waiting request that admission leaves out or
        mid-chunk: the scheduler finds out after admitting, and rolls admission back."""
        op = data.draw(st.sampled_from(self._invalid_ops()), label="op")
        for name, side in (("reference", self.lock.ref), ("fast", self.lock.fast)):
            before = side.snapshot()
            try:
                side.apply(dict(op))
            except InvalidOp:
                self._check(side.snapshot() == before, f"the refused operation {op} changed the {name}'s state")
                continue
            self._check(False, f"{name} accepted the invalid operation {op}")

    @rule(family=st.integers(0, 2), keep=st.integers(0, 48))
    def probe(self, family: int, keep: int) -> None:
        self._do({"op": "probe", "tokens": self.families[family % len(self.families)][:keep]})

    @precondition(lambda self: self.header.cache_type == "radix")
    @rule(family=st.integers(0, 2), keep=st.integers(1, 48), times=st.integers(1, 48))
    def hot_prefix(self, family: int, keep: int, times: int) -> None:
        """A hot prefix, matched again and again between evictions: each match of a cached leaf
        re-enters it in fast's heap of evictable leaves, so stale entries pile up until the heap
        drops them all at once (it keeps at most 4 per node, plus 64). A prefix nothing of which is
        cached is not hot: the loop stops there."""
        tokens = self.families[family % len(self.families)][:keep]
        for _ in range(times):
            if not self._do({"op": "probe", "tokens": tokens}).cached_len:
                break

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
        tokens = sum(r.max_device_len - r.device_len + 1 for r in ref.live.values()) + sum(
            p.output_len + div_ceil(p.input_len, budget) for p in ref.waiting
        )
        bound = (requests + 1) * tokens + 10
        before, ops = self.preempted_seen, 0
        while ref.waiting or ref.live:
            self._check(
                ops < bound,
                f"liveness: {len(ref.waiting)} waiting and {len(ref.live)} live requests "
                f"still there after {ops} operations (bound {bound})",
            )
            if ref.waiting:
                result = self._do({"op": "prefill", "budget": budget, "sample": sample})
                ops += 1
                if result.batch or result.preempted:
                    continue
            self._check(
                ref.dm.runnable,
                f"liveness: nothing admitted and nothing running; waiting "
                f"{[p.uid for p in ref.waiting]}, live {sorted(ref.live)}",
            )
            self._do({"op": "decode", "sample": sample})
            ops += 1
        if self.preempted_seen > before:
            note("driver: drain ended requests that were preempted")

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
            note("driver: idle")


def run_machine(chosen: settings | None = None) -> None:
    """Run the state machine as the test suite does, through `LockstepMachine.TestCase`, under
    `chosen` or else the loaded profile (as the TestCase's own settings: no deadline, no health
    check); raises the failure, if any. The TestCase class is made once and keeps the settings it
    was made with, so they are set here, not left to whenever it was first touched."""
    case = LockstepMachine.TestCase
    case.settings = chosen or settings(settings.default, deadline=None, suppress_health_check=list(HealthCheck))
    case("runTest").runTest()
