"""`kvledger fuzz`: a random-walk differential fuzzer over the lockstep harness.

Faster than the Hypothesis machine (no shrinking bookkeeping, no strategies): each worker
process runs "cases", each a fresh random configuration weighted toward the edges (tiny pools,
eviction pressure, shared prefixes over a small alphabet, every page size, both caches, small
prefill budgets that chunk, both admission policies) and a few hundred operations chosen from the
model's state. An optimistic case (OPTIMISTIC_SHARE of them) has long outputs and a pool of half
to once its largest request's worst case, so steps preempt often; its submits are clipped until
their worst case fits the pool (a bigger one is an InvalidOp under optimistic admission). The
policy is drawn last: a reserve case is exactly the case it was before optimistic admission.

Case k of worker w under seed s is generated from a seed derived from (s, w, k) alone, so the
same seed and worker count give the same cases; time only decides how many run. On the first
divergence every worker stops, the failing trace is written, minimized, and the command that
replays it is printed.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import multiprocessing as mp
import queue as queue_mod
import random
import signal
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import InvalidOp, OpResult
from kvledger.engine.ledger.trace import Header
from kvledger.properties.machine import invalid_ops
from kvledger.reference.pages import div_ceil

log = logging.getLogger(__name__)
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


def make_case(seed: int, admission: Optional[str] = None) -> Case:
    """Case `seed`; `admission` ("reserve" or "optimistic") forces the policy, else it is drawn."""
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
    policy = {}
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

    def next_op(self, ref: CacheScheduler) -> Dict:
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
            tokens = rng.choice([1, case.header.page_size, evictable, rng.randint(1, evictable)])
            tokens = min(tokens, evictable)
            if tokens == evictable:
                self.note("fuzz: evict everything evictable")
            return {"op": "evict", "tokens": tokens}
        return {"op": "probe", "tokens": self._tokens(case.max_prompt)}

    def observe(self, op: Dict, result: OpResult, ref: CacheScheduler) -> None:
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
) -> Iterator[None]:
    """Run case `seed` on `lock` (a Lockstep built from make_case(seed, admission).header), one
    operation per iteration, for the case's length (or `length`); a Finding propagates.

    Besides the comparison after every operation, the walk judges what the Hypothesis machine
    judges with its `invalid` and `drain` rules: after about one operation in REFUSAL_EVERY, an
    operation the scheduler must refuse, on both sides, must change nothing (drawn from a random
    stream of its own, so the valid operations are those of the walk without it); and at the end
    of an optimistic case, every request must end once submissions stop (`drain`)."""
    case = make_case(seed, admission)
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
) -> Tuple[Header, List[Dict]]:
    """Case `case` of worker `worker` under `seed` (and `admission`, if forced), run here (apply a
    bug with zoo.patched around it): the trace up to its end, `max_ops` (which may also lengthen
    the case), or its divergence (included)."""
    from kvledger.properties.lockstep import Finding, Lockstep

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


# -- worker processes ---------------------------------------------------------------------------
REPORT_EVERY = 0.25  # seconds between a worker's progress messages
PROGRESS_EVERY = 5.0  # seconds between the progress lines logged (INFO)
OP_LIMIT_S = 10.0  # an operation still running after this long is reported as a hang


class OpTimeout(Exception):
    """One operation ran past its time limit (a buggy method looping forever, say)."""


def _raise_timeout(signum, frame):
    raise OpTimeout


def limited_steps(steps: Iterator[None], seconds: float) -> Iterator[None]:
    """Advance `steps` one at a time, each within `seconds` of wall time (SIGALRM, main thread of
    a Unix process); a step past it raises OpTimeout."""
    old = signal.signal(signal.SIGALRM, _raise_timeout)
    try:
        while True:
            signal.setitimer(signal.ITIMER_REAL, seconds)
            try:
                next(steps)
            except StopIteration:
                return
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            yield
    finally:
        signal.signal(signal.SIGALRM, old)


# -- what a worker tells the parent (through a multiprocessing queue) ----------------------------
@dataclass
class Ready:
    worker: int


@dataclass
class Progress:
    worker: int
    ops: int
    cases: int
    reached: List[str]  # rare events first reached since the last report
    preemptions: int = 0  # requests preempted since the last report
    optimistic_cases: int = 0  # optimistic cases completed since the last report


@dataclass
class Done:
    worker: int


@dataclass
class WorkerFailure:
    kind: str  # "divergence", "crash" or "hang"
    worker: int
    case_no: int
    header: Dict[str, Any]
    ops: List[Dict[str, Any]]
    detail: str  # the divergence's detail, the traceback, or what hung
    divergence_kind: Optional[str] = None
    step: Optional[int] = None


def _worker(
    index: int,
    seed: int,
    seconds: float,
    bug: Optional[str],
    out: Any,
    stop: Any,
    op_limit: float = OP_LIMIT_S,
    admission: Optional[str] = None,
    max_cases: Optional[int] = None,
) -> None:
    import torch

    torch.set_num_threads(1)  # tiny tensors; workers share the cores
    from kvledger.properties.lockstep import Finding, Lockstep
    from kvledger.reference import events
    from kvledger.subjects.fast_zoo import patched

    reached: Set[str] = set()
    sent: Set[str] = set()
    ops = cases = preemptions = optimistic_cases = 0
    last = time.monotonic()

    def flush(force: bool = False) -> None:
        nonlocal ops, cases, preemptions, optimistic_cases, last
        now = time.monotonic()
        if force or now - last >= REPORT_EVERY:
            out.put(Progress(index, ops, cases, sorted(reached - sent), preemptions, optimistic_cases))
            sent.update(reached)
            ops = cases = preemptions = optimistic_cases = 0
            last = now

    def keep_going() -> bool:
        return not stop.is_set() and time.monotonic() < deadline

    events.set_listener(reached.add)
    # the clock starts once imports are done: a loaded machine may take seconds to spawn us
    deadline = time.monotonic() + seconds
    out.put(Ready(index))
    with patched(bug):
        number = 0
        while keep_going() and (max_cases is None or number < max_cases):
            cseed = case_seed(seed, index, number)
            lock = Lockstep(make_case(cseed, admission).header)
            counted = 0  # of this case's preemptions, those already counted
            try:
                for _ in limited_steps(walk(cseed, lock, reached.add, keep_going, admission=admission), op_limit):
                    ops += 1
                    preemptions += lock.ref.preemptions - counted
                    counted = lock.ref.preemptions
                    flush()
            except OpTimeout:
                flush(force=True)
                detail = f"operation {len(lock.ops)} ({lock.ops[-1].get('op')}) ran past {op_limit:g} s"
                out.put(WorkerFailure("hang", index, number, asdict(lock.header), list(lock.ops), detail))
                return
            except Finding as e:
                flush(force=True)
                out.put(
                    WorkerFailure(
                        "divergence", index, number, asdict(lock.header), list(lock.ops), e.message, e.kind, e.step
                    )
                )
                return
            except Exception:
                flush(force=True)
                out.put(
                    WorkerFailure("crash", index, number, asdict(lock.header), list(lock.ops), traceback.format_exc())
                )
                return
            cases += 1
            optimistic_cases += lock.header.policy.preempts
            number += 1
    flush(force=True)
    out.put(Done(index))


# -- the parent ---------------------------------------------------------------------------------
@dataclass
class FuzzFailure:
    kind: str  # the divergence kind, "crash" or "hang"
    step: int
    detail: str
    worker: int
    case: int
    trace_path: Path
    minimized_path: Optional[Path] = None
    minimized_ops: Optional[int] = None
    minimized_kind: Optional[str] = None


@dataclass
class FuzzResult:
    ops: int
    cases: int
    seconds: float
    workers: int
    seed: int
    bug: Optional[str] = None
    events: List[str] = field(default_factory=list)
    failure: Optional[FuzzFailure] = None
    seconds_to_find: Optional[float] = None  # from the first worker ready to the first failure
    preemptions: int = 0  # requests preempted, over every case run
    optimistic_cases: int = 0  # complete cases under optimistic admission

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else 0.0

    @property
    def exit_code(self) -> int:
        if self.failure is None:
            return 0
        return 2 if self.failure.kind == "crash" else 1  # a hang is a bug in the code under test


def _expected_events() -> Set[str]:
    # the rare branches the property run must reach, but those of its rules the fuzzer has not
    from kvledger.properties.machine import EXPECTED_EVENTS, MACHINE_ONLY_EVENTS

    return set(EXPECTED_EVENTS - MACHINE_ONLY_EVENTS) | FUZZ_EVENTS


def _progress_line(elapsed: float, seconds: float, ops: int, cases: int, reached: Set[str], expected: Set[str]) -> str:
    rate = ops / elapsed if elapsed > 0 else 0.0
    return (
        f"fuzz {elapsed:5.1f}/{seconds:g}s  {ops:,} ops ({rate:,.0f} ops/s)  {cases:,} cases  "
        f"events {len(reached & expected)}/{len(expected)} (+{len(reached - expected)} other)"
    )


def fuzz(
    seconds: float,
    workers: int = 1,
    seed: int = 0,
    out_dir: str | Path = ".kvledger/fuzz",
    bug: Optional[str] = None,
    progress: bool = True,
    minimize_budget: float = 60.0,
    admission: Optional[str] = None,
    max_cases: Optional[int] = None,
    minimize_replays: Optional[int] = None,
) -> FuzzResult:
    """Fuzz reference vs fast for `seconds` on `workers` processes; see the module docstring.
    `admission` forces every case's policy; `max_cases` stops each worker after that many cases
    (then the run is the same whatever the machine's speed, as long as `seconds` is not reached);
    `minimize_replays` bounds the minimization of a failure by replays as well as by seconds."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if admission is not None and admission not in ADMISSIONS:
        raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, got {admission!r}")
    if max_cases is not None and max_cases < 1:
        raise ValueError(f"max_cases must be >= 1, got {max_cases}")
    if bug is not None:
        from kvledger.subjects.fast_zoo import BUGS

        if bug not in BUGS:
            raise KeyError(f"unknown bug {bug!r}; known: {', '.join(sorted(BUGS))}")
    expected = _expected_events()
    ctx = mp.get_context("spawn")  # fresh interpreters: no inherited torch threads or patches
    messages = ctx.Queue()
    stop = ctx.Event()
    start = time.monotonic()
    procs = [
        ctx.Process(
            target=_worker, args=(i, seed, seconds, bug, messages, stop, OP_LIMIT_S, admission, max_cases), daemon=True
        )
        for i in range(workers)
    ]
    for p in procs:
        p.start()
    ops = cases = 0
    counts = {"preemptions": 0, "optimistic_cases": 0}
    reached: Set[str] = set()
    failure_msg = None
    found_at = None
    fuzz_start: Optional[float] = None  # when the first worker was ready
    done = 0
    last_print = start
    try:
        while done < workers and failure_msg is None:
            try:
                msg = messages.get(timeout=0.2)
            except queue_mod.Empty:
                msg = None
                if not any(p.is_alive() for p in procs) and messages.empty():
                    break  # a worker died without a word (killed); stop
            if isinstance(msg, Progress):
                ops += msg.ops
                cases += msg.cases
                reached.update(msg.reached)
                _count(counts, msg)
            elif isinstance(msg, Ready):
                fuzz_start = fuzz_start or time.monotonic()
            elif isinstance(msg, Done):
                done += 1
            elif isinstance(msg, WorkerFailure):
                failure_msg = msg
                found_at = time.monotonic() - (fuzz_start or start)
            now = time.monotonic()
            if progress and fuzz_start is not None and now - last_print >= PROGRESS_EVERY:
                log.info(_progress_line(now - fuzz_start, seconds, ops, cases, reached, expected))
                last_print = now
    finally:
        stop.set()
        ops, cases = _drain_and_join(procs, messages, ops, cases, reached, counts)
    elapsed = time.monotonic() - (fuzz_start or start)
    result = FuzzResult(ops, cases, elapsed, workers, seed, bug, sorted(reached), seconds_to_find=found_at, **counts)
    if failure_msg is not None:
        result.failure = _handle_failure(
            failure_msg, Path(out_dir), seed, bug, minimize_budget, progress, minimize_replays
        )
    if progress:
        print(format_summary(result, expected))
    return result


def _count(counts: Dict[str, int], msg: Progress) -> None:
    counts["preemptions"] += msg.preemptions
    counts["optimistic_cases"] += msg.optimistic_cases


def _drain_and_join(
    procs: List[Any], messages: Any, ops: int, cases: int, reached: Set[str], counts: Optional[Dict[str, int]] = None
) -> tuple:
    # A process that has queued messages exits only once they are read: drain while joining.
    counts = counts if counts is not None else {"preemptions": 0, "optimistic_cases": 0}
    end = time.monotonic() + 10.0
    while any(p.is_alive() for p in procs) and time.monotonic() < end:
        try:
            msg = messages.get(timeout=0.1)
            if isinstance(msg, Progress):
                ops, cases = ops + msg.ops, cases + msg.cases
                reached.update(msg.reached)
                _count(counts, msg)
        except queue_mod.Empty:
            pass
    for p in procs:
        if p.is_alive():
            p.terminate()
        p.join(timeout=5.0)
    return ops, cases


def _handle_failure(
    msg: WorkerFailure,
    out_dir: Path,
    seed: int,
    bug: Optional[str],
    budget: float,
    progress: bool,
    max_replays: Optional[int] = None,
) -> FuzzFailure:
    from kvledger.checker.minimize import MinimizeError, minimize
    from kvledger.engine.ledger import trace
    from kvledger.subjects.fast_zoo import patched

    kind_of_msg, worker, case_no, ops = msg.kind, msg.worker, msg.case_no, msg.ops
    header = Header(**msg.header)
    name = f"fuzz-s{seed}-w{worker}-c{case_no}"
    path = out_dir / f"{name}.jsonl"
    trace.write(path, header, ops)
    if kind_of_msg in ("crash", "hang"):  # a hang is not minimized: each candidate could hang too
        if progress:
            log.info(
                "%s in worker %s, case %s: %s\n  trace: %s (%d ops)",
                kind_of_msg.upper(),
                worker,
                case_no,
                msg.detail.splitlines()[-1],
                path,
                len(ops),
            )
        return FuzzFailure(kind_of_msg, len(ops), msg.detail, worker, case_no, path)
    kind, step, detail = msg.divergence_kind, msg.step, msg.detail
    failure = FuzzFailure(kind, step, detail, worker, case_no, path)
    if progress:
        log.info(
            "DIVERGED in worker %s, case %s, step %s: %s\n  %s\n  trace: %s (%d ops); minimizing (budget %gs)...",
            worker,
            case_no,
            step,
            kind,
            detail,
            path,
            len(ops),
            budget,
        )
    if kind.startswith(RUN_PROPERTY_KINDS):  # the trace alone replays clean: the walk's check failed
        failure.detail += " (a property of the run, not of the trace's replay: not minimized)"
        return failure
    try:
        with patched(bug):
            m_header, m_ops, m_kind = minimize(
                header, ops, budget=budget, log=log.info if progress else None, max_replays=max_replays
            )
    except MinimizeError as e:  # the divergence did not reproduce in this process
        failure.detail += f" (could not minimize: {e})"
        return failure
    failure.minimized_path = out_dir / f"{name}-min.jsonl"
    trace.write(failure.minimized_path, m_header, m_ops)
    failure.minimized_ops, failure.minimized_kind = len(m_ops), m_kind
    return failure


def format_summary(result: FuzzResult, expected: Set[str] | None = None) -> str:
    expected = expected if expected is not None else _expected_events()
    reached = set(result.events)
    lines = [
        f"{result.ops:,} operations in {result.cases:,} complete cases, {result.seconds:.1f}s on "
        f"{result.workers} worker(s) (seed {result.seed}): {result.ops_per_s:,.0f} ops/s"
    ]
    lines.append(
        f"optimistic admission: {result.optimistic_cases:,} complete cases, {result.preemptions:,} requests preempted"
    )
    lines.append(f"rare events reached ({len(reached & expected)}/{len(expected)}):")
    lines += [f"  [{'x' if name in reached else ' '}] {name}" for name in sorted(expected)]
    others = sorted(reached - expected)
    if others:
        lines.append("other events: " + ", ".join(others))
    f = result.failure
    if f is None:
        lines.append("no divergence")
    elif f.kind == "crash":
        lines.append(f"CRASH in worker {f.worker}, case {f.case} (not a divergence):\n{f.detail}")
        lines.append(f"trace up to the crash: {f.trace_path}")
    elif f.kind == "hang":
        lines.append(f"HANG in worker {f.worker}, case {f.case}: {f.detail}")
        lines.append(f"trace up to and including that operation: {f.trace_path} (not minimized)")
    else:
        lines.append(f"DIVERGENCE {f.kind} at step {f.step} (worker {f.worker}, case {f.case}): {f.detail}")
        lines.append(f"failing trace: {f.trace_path}")
        if f.minimized_path is not None:
            lines.append(f"minimized ({f.minimized_ops} ops, {f.minimized_kind}): {f.minimized_path}")
        lines.append(f"replay it: kvledger replay {f.minimized_path or f.trace_path}")
        if result.bug is not None:
            lines.append(
                f"  (it diverges only with bug {result.bug!r} patched in: "
                f"kvledger replay/minimize/show ... --bug {result.bug})"
            )
    return "\n".join(lines)
