"""The lockstep workload: how `kvledger fuzz` chooses operations for reference against fast.

Each case is a fresh random configuration weighted toward the edges (tiny pools, eviction
pressure, shared prefixes over a small alphabet, every page size, both caches, small prefill
budgets that chunk, both admission policies) and a few hundred operations chosen from the model's
(the reference CacheScheduler's) state. An optimistic case (OPTIMISTIC_SHARE of them) has long
outputs and a pool of half to once its largest request's worst case, so steps preempt often; its
submits are clipped until their worst case fits the pool (a bigger one is an InvalidOp under
optimistic admission). The policy is drawn last: a reserve case is exactly the case it was before
optimistic admission.

Case k of worker w under seed s is generated from a seed derived from (s, w, k) alone, so the
same seed and worker count give the same cases. Besides the comparison after every operation,
the walk checks refusals and, for an optimistic case, liveness (`walk`). `LockstepWorkload` is
this module as the fuzzer (`checker/fuzz.py`) sees a workload.
"""

from __future__ import annotations

import hashlib
import inspect
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import InvalidOp, OpRecord, OpResult
from kvledger.engine.ledger.trace import Header
from kvledger.properties.lockstep import Lockstep
from kvledger.properties.machine import invalid_ops
from kvledger.properties.target import LockstepTarget, Run
from kvledger.reference.pages import div_ceil

PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64)
# the in-progress driver may name requests whose sampled token ends them (EOS)
_HAS_STOP = "stop" in inspect.signature(CacheScheduler.decode).parameters

# events the fuzzer notes itself, on top of the model's `reference.events`
FUZZ_EVENTS = frozenset(
    {
        "driver: rejected request admitted later",
        "driver: several requests prefill together",
        "driver: abort mid-chunk",
        "driver: idle",
        "fuzz: pool exhausted (no free page)",
        "fuzz: request larger than the pool",
        "fuzz: evict everything evictable",
        "fuzz: every table slot in use",
        "fuzz: preemption in a prefill step",
        "fuzz: preemption in a decode step",
    }
)
ADMISSIONS = ("reserve", "optimistic")
OPTIMISTIC_SHARE = 0.4  # of the cases, when the policy is not forced
RESERVE_RATIOS = (0.0, 0.0, 0.0, 0.25, 0.5, 0.75)  # 0 reserves least: most preemption
REFUSAL_EVERY = 32  # an invalid operation after one valid operation in this many, on average
# findings that are properties of the run, not of the trace's replay: not minimized
RUN_PROPERTY_KINDS = ("liveness", "refusal:", "accepted-invalid:")
SPEC_DRAFTS = 4  # a speculating case's drafts per request per decode, at most


def case_seed(seed: int, worker: int, case: int) -> int:
    digest = hashlib.sha256(f"kvledger-fuzz/{seed}/{worker}/{case}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


# -- one case: a configuration and a random walk ------------------------------------------------
@dataclass
class Case:
    header: Header
    families: List[List[int]]  # shared prompt prefixes
    alphabet: int
    weights: Dict[str, float]
    budgets: List[int]
    max_prompt: int
    max_new: int
    length: int  # operations to run


def make_case(seed: int, admission: Optional[str] = None, speculate: bool = False) -> Case:
    """Case `seed`; `admission` ("reserve" or "optimistic") forces the policy, else it is drawn;
    `speculate`: its decodes verify 1 to SPEC_DRAFTS drafts per request (drawn last)."""
    if admission is not None and admission not in ADMISSIONS:
        raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, got {admission!r}")
    rng = random.Random(seed)
    ps = rng.choice(PAGE_SIZES)
    num_pages = rng.choice([1, 2, 3, 4, 5, 6, 8, 8, 12, 16, 16, 24, 32, 64, 256])
    table_slots = rng.choice([1, 2, 3, 4, 4, 6, 8, 16])
    pages_per_req = rng.choice([1, 1, 2, 3, 4, 8])
    max_new = rng.choice([1, 2, 3, 4, 8, 2 * ps])
    max_prompt = max(2, pages_per_req * ps + 1)
    # max_seq_len is a multiple of the page size: a page-table row holds whole pages
    max_seq_len = -(-(max_prompt + max_new) // ps) * ps
    alphabet = rng.choice([1, 2, 3, 4, 8])
    families = [[rng.randrange(alphabet) for _ in range(max_prompt)] for _ in range(rng.randint(1, 3))]
    weights = {"submit": 3.0, "prefill": 3.0, "decode": 4.0, "finish": 0.5, "abort": 0.5, "evict": 0.5, "probe": 0.5}
    for name in ("finish", "evict", "probe"):
        weights[name] *= rng.choice([0.0, 1.0, 2.0, 4.0])
    weights["abort"] *= rng.choice([0.2, 1.0, 2.0, 4.0])  # aborts unblock a queue head that never fits
    if rng.random() < 0.3:  # chunking: budgets around a page
        budgets = sorted({max(1, b) for b in (1, 2, ps - 1, ps, ps + 1, 2 * ps + 1)})
    else:
        budgets = [max_prompt, 4 * max_prompt, 1 << 20]
    cache_type = rng.choice(["radix", "naive"])
    length = rng.randint(100, 500)
    # drawn after everything else, so a reserve case is the case it was before optimistic admission
    draw = rng.random()  # drawn even when the policy is forced, so the rest of the case is the same
    optimistic = draw < OPTIMISTIC_SHARE if admission is None else admission == "optimistic"
    policy: Dict[str, Any] = {}
    if optimistic:
        # outputs long enough to outgrow what admission reserved for them, and a pool of half to
        # once the largest request's worst case: a few live requests outgrow it, preemption
        # makes room (submits are clipped to fit it, see Walker.next_op)
        max_new = max(max_new, rng.choice([2 * ps, 4 * ps, 16, 32]))
        max_seq_len = -(-(max_prompt + max_new) // ps) * ps
        worst = -(-(max_prompt + max_new - 1) // ps)  # pages
        num_pages = max(2, rng.randint(worst // 2, worst + 1))
        weights["decode"] *= 2  # requests outgrow their reservation by decoding
        policy = {"admission": "optimistic", "reserve_ratio": rng.choice(RESERVE_RATIOS)}
    header = Header(
        num_pages=num_pages,
        page_size=ps,
        cache_type=cache_type,
        table_slots=table_slots,
        max_seq_len=max_seq_len,
        seed=seed,
        producer="fuzz",
        **policy,
    )
    if speculate:
        header = replace(header, spec_tokens=rng.randint(1, SPEC_DRAFTS))
    return Case(header, families, alphabet, weights, budgets, max_prompt, max_new, length)


class Walker:
    """Chooses the next valid operation from the model's (reference cache scheduler's) state."""

    def __init__(self, case: Case, rng: random.Random, note: Callable[[str], None]) -> None:
        self.case, self.rng, self.note = case, rng, note
        self.next_uid = 0
        self.rejected: Set[int] = set()

    def _length(self, limit: int) -> int:
        ps, rng = self.case.header.page_size, self.rng
        if rng.random() < 0.6:  # near a page boundary
            return max(1, min(limit, rng.randint(0, limit // ps + 1) * ps + rng.choice([-1, 0, 1])))
        return rng.randint(1, max(1, limit))

    def _tokens(self, limit: int) -> List[int]:
        rng = self.rng
        n = self._length(limit)
        if rng.random() < 0.8:
            keep = rng.randint(0, n)
            prefix = rng.choice(self.case.families)[:keep]
        else:
            prefix = []
        return prefix + [rng.randrange(self.case.alphabet) for _ in range(n - len(prefix))]

    def _sample(self) -> List[int]:
        return [self.rng.randrange(self.case.alphabet) for _ in range(self.rng.randint(0, 3))]

    def next_op(self, ref: CacheScheduler) -> Dict[str, Any]:
        rng, case = self.rng, self.case
        running = ref.dm.running_reqs.uids()
        waiting = [p.uid for p in ref.waiting]
        evictable = ref.cm.prefix_cache.size_info.evictable_size
        choices = {
            "submit": True,
            "prefill": bool(waiting),
            "decode": bool(running),
            "finish": bool(running),
            "abort": bool(running or waiting),
            "evict": evictable > 0,
            "probe": True,
        }
        names = [n for n, ok in choices.items() if ok and case.weights[n] > 0]
        kind = rng.choices(names, [case.weights[n] for n in names])[0]
        if kind == "submit":
            tokens = self._tokens(case.max_prompt)
            max_tokens = rng.randint(1, case.max_new)
            pool = case.header.num_pages * case.header.page_size
            if case.header.policy.preempts and len(tokens) + max_tokens > pool + 1:
                # its worst case must fit the pool (else the submit is an InvalidOp): always clip,
                # the output to at most the pool, then the prompt (a shared prefix stays a prefix)
                max_tokens = min(max_tokens, pool)
                tokens = tokens[: pool + 1 - max_tokens]
            elif len(tokens) + max_tokens > pool + 1:  # can never be admitted: mostly trim it to fit
                if rng.random() < 0.9 and pool > max_tokens:
                    tokens = tokens[: pool + 1 - max_tokens]
                else:
                    self.note("fuzz: request larger than the pool")
            self.next_uid += 1
            return {"op": "submit", "uid": self.next_uid - 1, "tokens": tokens, "max_tokens": max_tokens}
        if kind == "prefill":
            return {"op": "prefill", "budget": rng.choice(case.budgets), "sample": self._sample()}
        if kind == "decode":
            op: Dict[str, Any] = {"op": "decode", "sample": self._sample()}
            drafts = case.header.spec_tokens
            if drafts:  # how many of each request's drafts the model accepts (cycled); none, some, all
                op["accept"] = [rng.choice([0, rng.randint(0, drafts), drafts]) for _ in range(rng.randint(0, 3))]
            if _HAS_STOP and rng.random() < 0.1:
                if case.header.policy.preempts:
                    # a request the step preempts samples no token, so it cannot stop: name only
                    # the oldest live request, which is never preempted, if it is running
                    oldest = next(iter(ref.live), None)
                    if oldest in running:
                        op["stop"] = [oldest]
                else:
                    op["stop"] = rng.sample(running, rng.randint(1, len(running)))
            return op
        if kind == "finish":
            return {"op": "finish", "uid": rng.choice(running)}
        if kind == "abort":
            uid = rng.choice(waiting + running)
            if any(p.uid == uid and p.chunked_req is not None for p in ref.waiting):
                self.note("driver: abort mid-chunk")
            return {"op": "abort", "uid": uid}
        if kind == "evict":
            size = min(rng.choice([1, case.header.page_size, evictable, rng.randint(1, evictable)]), evictable)
            if size == evictable:
                self.note("fuzz: evict everything evictable")
            return {"op": "evict", "tokens": size}
        return {"op": "probe", "tokens": self._tokens(case.max_prompt)}

    def observe(self, op: Dict[str, Any], result: OpResult, ref: CacheScheduler) -> None:
        if op["op"] == "prefill":
            if self.rejected & set(result.batch or ()):
                self.note("driver: rejected request admitted later")
            if result.refused is not None:
                self.rejected.add(result.refused)
            if len(result.batch or ()) > 1:
                self.note("driver: several requests prefill together")
        if result.preempted:
            self.note(f"fuzz: preemption in a {op['op']} step")
            if not result.batch:
                self.note("driver: every request of a step preempted")
        if not ref.live and not ref.waiting and len(ref.known) > 0:
            self.note("driver: idle")
        if len(ref.cm.free_slots) == 0:
            self.note("fuzz: pool exhausted (no free page)")
        if ref.tm.available_size == 0:
            self.note("fuzz: every table slot in use")


def walk(
    seed: int,
    lock: Any,
    note: Callable[[str], None],
    keep_going: Callable[[], bool],
    length: Optional[int] = None,
    admission: Optional[str] = None,
    speculate: bool = False,
) -> Iterator[None]:
    """Run case `seed` on `lock` (a Lockstep built from make_case(seed, admission, speculate).header), one
    operation per iteration, for the case's length (or `length`); a Finding propagates.

    Besides the comparison after every operation, the walk judges what the Hypothesis machine
    judges with its `invalid` and `drain` rules: after about one operation in REFUSAL_EVERY, an
    operation the scheduler must refuse, on both sides, must change nothing (drawn from a random
    stream of its own, so the valid operations are those of the walk without it); and at the end
    of an optimistic case, every request must end once submissions stop (`drain`)."""
    case = make_case(seed, admission, speculate)
    walker = Walker(case, random.Random(seed + 1), note)
    refusals = random.Random(seed + 2)
    for _ in range(length or case.length):
        if not keep_going():
            return
        op = walker.next_op(lock.ref)
        walker.observe(op, lock.apply(op), lock.ref)
        if refusals.randrange(REFUSAL_EVERY) == 0:
            check_refusal(lock, refusals.choice(invalid_ops(lock.ref, case.header, walker.next_uid)))
        yield
    if case.header.policy.preempts and length is None and keep_going():
        rng = walker.rng
        sample = [rng.randrange(case.alphabet) for _ in range(rng.randint(1, 4))]
        yield from drain(lock, rng.choice(case.budgets), sample, note)


def check_refusal(lock: Any, op: Dict[str, Any]) -> None:
    """`op` must be refused (InvalidOp) by each side and change nothing there: a trace keeps only
    valid operations, so a refusal that changed state would not replay."""
    for name, side in (("reference", lock.ref), ("fast", lock.fast)):
        before = side.snapshot()
        try:
            side.apply(dict(op))
        except InvalidOp:
            if side.snapshot() != before:
                raise Finding(
                    f"refusal:{op.get('op')}",
                    f"the refused operation {op} changed the {name}'s state",
                    step=lock.step,
                    op=op,
                ) from None
            continue
        kind = f"accepted-invalid:{op.get('op')}"
        raise Finding(kind, f"{name} accepted the invalid operation {op}", step=lock.step, op=op)


def drain(lock: Any, budget: int, sample: List[int], note: Callable[[str], None]) -> Iterator[None]:
    """Liveness under optimistic admission: with no new requests, drive the scheduler as the
    engine does (prefill while admission yields a batch, else decode); every request, waiting or
    live, must end within a bound counted from what is outstanding (operations, never time),
    however often it is preempted. One operation per iteration; a request that never ends is a
    `liveness` Finding."""
    ref = lock.ref
    requests = len({p.uid for p in ref.waiting} | set(ref.live))
    tokens = sum(r.max_device_len - r.device_len + 1 for r in ref.live.values()) + sum(
        p.output_len + div_ceil(p.input_len, budget) for p in ref.waiting
    )
    bound = (requests + 1) * tokens + 10
    preemptions, ops = ref.preemptions, 0

    def stuck(why: str) -> Finding:
        return Finding(
            "liveness",
            f"{why}: waiting {[p.uid for p in ref.waiting]}, live {sorted(ref.live)} after {ops} operations "
            f"of the drain (bound {bound})",
            step=lock.step,
            op=lock.ops[-1] if lock.ops else None,
        )

    while ref.waiting or ref.live:
        if ops >= bound:
            raise stuck("requests still there once submissions stopped")
        if ref.waiting:
            result = lock.apply({"op": "prefill", "budget": budget, "sample": sample})
            ops += 1
            yield
            if result.batch or result.preempted:
                continue
        if not ref.dm.runnable:
            raise stuck("nothing admitted and nothing running")
        lock.apply({"op": "decode", "sample": sample})
        ops += 1
        yield
    if ref.preemptions > preemptions:
        note("driver: drain ended requests that were preempted")


def case_trace(
    seed: int, worker: int, case: int, max_ops: Optional[int] = None, admission: Optional[str] = None
) -> Tuple[Header, List[OpRecord]]:
    """Case `case` of worker `worker` under `seed` (and `admission`, if forced), run here (apply a
    bug with zoo.patched around it): the trace up to its end, `max_ops` (which may also lengthen
    the case), or its divergence (included)."""
    cseed = case_seed(seed, worker, case)
    lock = Lockstep(make_case(cseed, admission).header)
    try:
        for n, _ in enumerate(
            walk(cseed, lock, lambda name: None, lambda: True, length=max_ops, admission=admission), 1
        ):
            if max_ops is not None and n >= max_ops:
                break
    except Finding:
        pass
    return lock.header, list(lock.ops)


def expected_events() -> Set[str]:
    """The rare branches the property run must reach, but those of its rules the fuzzer has not,
    and the fuzzer's own events."""
    from kvledger.properties.machine import EXPECTED_EVENTS, MACHINE_ONLY_EVENTS

    return set(EXPECTED_EVENTS - MACHINE_ONLY_EVENTS) | FUZZ_EVENTS


class LockstepWorkload:
    """Reference against fast as the fuzzer walks it: the walk above, the first divergence ends
    the run (every later case would only diverge again), structure-aware minimization."""

    producer = "fuzz"
    stops_at_first = True
    zoo_cases = 100  # the zoo's fuzz budget per bug (its CI-profile sequences decide too)
    zoo_minimize = (60.0, 2000)  # replays of microseconds: the replays bound it in practice

    def __init__(self, target: LockstepTarget, admission: Optional[str] = None) -> None:
        if admission is not None and admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, got {admission!r}")
        self.target = target
        self.admission = admission

    def prepare(self) -> None:
        """Nothing to build ahead: an unknown bug is a KeyError once the target is active."""
        if self.target.bug is not None:
            from kvledger.subjects.fast_zoo import BUGS

            if self.target.bug not in BUGS:
                raise KeyError(f"unknown bug {self.target.bug!r}; known: {', '.join(sorted(BUGS))}")

    def case_seed(self, seed: int, worker: int, workers: int, case: int) -> int:
        return case_seed(seed, worker, case)

    def task_seed(self, seed: int, shard: int, case: int) -> int:
        return case_seed(seed, shard, case)

    def header(self, cseed: int) -> Header:
        return make_case(cseed, self.admission, self.target.speculate).header

    def start(self, header: Header, note: Callable[[str], None]) -> Run:
        from kvledger.reference import events

        events.set_listener(note)
        return self.target.start(header)

    def walk(self, run: Any, cseed: int, note: Callable[[str], None], keep_going: Callable[[], bool]) -> Iterator[None]:
        return walk(cseed, run, note, keep_going, admission=self.admission, speculate=self.target.speculate)

    def preemptions(self, run: Any) -> int:
        return int(run.ref.preemptions)

    def expected_events(self) -> Set[str]:
        if self.target.speculate:
            from kvledger.properties.speculating_scheduler import SPEC_EVENTS

            return expected_events() | SPEC_EVENTS
        return expected_events()

    def trace_paths(self, out_dir: Path, seed: int, worker: int, case: int, cseed: int, kind: str) -> Tuple[Path, Path]:
        name = f"fuzz-s{seed}-w{worker}-c{case}"
        return out_dir / f"{name}.jsonl", out_dir / f"{name}-min.jsonl"

    def minimizes(self, kind: str) -> bool:
        """A hang could hang every candidate, a crash is no divergence, and a property of the run
        (liveness, a refusal) fails the walk, not the trace's replay."""
        return kind not in ("crash", "hang") and not kind.startswith(RUN_PROPERTY_KINDS)

    def minimize(
        self, header: Header, ops: List[OpRecord], kind: str, budget: float, replays: Optional[int], log: Any
    ) -> Tuple[Header, List[OpRecord], str]:
        """The structure-aware minimizer (MinimizeError if the failure does not reproduce)."""
        from kvledger.checker.minimize import minimize

        return minimize(header, ops, budget=budget, log=log, max_replays=replays, target=self.target)

    def replay_hint(self) -> str:
        bug = self.target.bug
        return (
            ""
            if bug is None
            else (f"  (it diverges only with bug {bug!r} patched in: kvledger replay/minimize/show ... --bug {bug})")
        )
