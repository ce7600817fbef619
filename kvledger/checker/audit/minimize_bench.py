"""Measure the minimizer on long failing traces: one ~1,000-operation trace per zoo bug.

    python -m properties.minimize_bench [--bugs A,B] [--ops 1000] [--budget 60] [--rebuild]

The acceptance target: a 1,000-operation failing trace minimizes to at most 10 operations in
under a minute. For each bug of the zoo the trace is built with the bug patched in, from the
fuzzer's first failing case (its header and its random-walk configuration):

  padding  segments of the case's random walk (fresh seeds), each followed by aborting every
           waiting and running request, until the target length. A segment that diverges is
           cut just before the divergence, so the padding itself agrees with the model.
  tail     a further walk from the padded state until it diverges: the failure comes last.

Traces are cached under .kvledger/minimize-bench/ (the bug's name), so repeated runs minimize
the same inputs; --rebuild makes them afresh.
"""

from __future__ import annotations

import argparse
import logging
import random
import signal
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from kvledger.checker.lockstep_walk import Case, Walker, case_seed, make_case, walk
from kvledger.checker.minimize import fingerprint_of, minimize
from kvledger.engine.ledger import trace
from kvledger.engine.ledger.trace import Header
from kvledger.properties.lockstep import Finding, Lockstep
from kvledger.subjects.fast_zoo import BUGS, patched

_log = logging.getLogger(__name__)  # `log` is the minimizer's callback

CACHE_DIR = Path(".kvledger/minimize-bench")
# large pools: every replayed operation checks every page, so these are the slow traces
MIN_PAGES = 32
WALK_LIMIT_S = 5.0
Ops = List[Dict]


class _Hang(Exception):
    """A walk ran past its time limit: some buggy methods loop forever (insert-unaligned's
    split at offset 0), and the harness has no timeout of its own."""


def _alarm(signum, frame):
    raise _Hang


def _walk_limited(
    lock: Lockstep, case: Case, rng_seed: int, length: int, drain: bool, seconds: float = WALK_LIMIT_S
) -> Lockstep:
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return _walk(lock, case, rng_seed, length, drain)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _first_failing_case(seed: int = 0, min_pages: int = MIN_PAGES, cases: int = 100) -> Case:
    """The walk configuration of the fuzzer's first case with at least `min_pages` pages that
    diverges (the bug patched in); else of its first case that diverges."""
    for number in range(cases):
        cseed = case_seed(seed, 0, number)
        if make_case(cseed).header.num_pages < min_pages:
            continue
        lock = Lockstep(make_case(cseed).header)
        try:
            for _ in walk(cseed, lock, lambda name: None, lambda: True, length=1000):
                pass
        except Finding:
            return make_case(cseed)
    if min_pages > 1:  # a bug that needs a tight pool
        return _first_failing_case(seed, 1, cases)
    raise RuntimeError(f"none of {cases} fuzz cases fails")


def _walk(lock: Lockstep, case: Case, rng_seed: int, length: int, drain: bool) -> Lockstep:
    """Walk `length` operations of `case` from `lock`'s state (then abort every request if
    `drain`). Raises a Finding with `.at`, the number of walk operations that agreed."""
    walker = Walker(case, random.Random(rng_seed), lambda name: None)
    walker.next_uid = len(lock.ref.known)  # uids stay unique across segments
    done = 0
    try:
        for done in range(length):  # noqa: B007 (read after the loop when the walk raises)
            op = walker.next_op(lock.ref)
            walker.observe(op, lock.apply(op), lock.ref)
        done = length
        if drain:
            for uid in [p.uid for p in lock.ref.waiting] + lock.ref.dm.running_reqs.uids():
                lock.apply({"op": "abort", "uid": uid})
    except Finding as e:
        e.at = done  # type: ignore[attr-defined]
        raise
    return lock


def _segment(lock: Lockstep, case: Case, rng_seed: int, length: int) -> Lockstep:
    """`lock` padded with the longest prefix (at most `length` operations) of one walk that,
    followed by aborting every request, agrees with the model. With none, a request that is
    submitted and aborted while waiting (the queue alone sees it)."""
    while length > 0:
        try:
            return _walk_limited(lock.copy(), case, rng_seed, length, drain=True)
        except Finding as e:  # in the walk (e.at < length) or in the draining aborts
            length = min(e.at, length - 1)
        except _Hang:
            length //= 2
    uid = len(lock.ref.known)
    lock.apply({"op": "submit", "uid": uid, "tokens": [0], "max_tokens": 1})
    lock.apply({"op": "abort", "uid": uid})
    return lock


def build_trace(bug: str, n_ops: int = 1000, seed: int = 0) -> Tuple[Header, Ops]:
    """A failing trace of about `n_ops` operations whose only divergence is at its end."""
    rng = random.Random(seed)
    with patched(bug):
        case = _first_failing_case(seed)
        lock = Lockstep(case.header)
        while len(lock.ops) < n_ops - 20:
            lock = _segment(lock, case, rng.getrandbits(32), min(rng.randint(10, 80), n_ops - len(lock.ops)))
        for _ in range(50):  # the tail: walk on until the bug fires
            tail = lock.copy()
            try:
                _walk_limited(tail, case, rng.getrandbits(32), 1000, drain=False)
            except _Hang:
                continue
            except Finding:
                return case.header, list(tail.ops)  # up to and including the divergence
        raise RuntimeError(f"{bug}: no walk from the padded state diverges")


def load_or_build(bug: str, n_ops: int = 1000, rebuild: bool = False) -> Tuple[Header, Ops]:
    path = CACHE_DIR / f"{bug}-{n_ops}.jsonl"
    if path.exists() and not rebuild:
        return trace.read(path)
    header, ops = build_trace(bug, n_ops)
    trace.write(path, header, ops)
    return header, ops


def measure(bug: str, n_ops: int = 1000, budget: float = 60.0, rebuild: bool = False, verbose: bool = False) -> Dict:
    header, ops = load_or_build(bug, n_ops, rebuild)
    log = (lambda line: _log.info("    %s", line)) if verbose else None
    with patched(bug):
        kind, step = fingerprint_of(header, ops)
        start = time.monotonic()
        m_header, m_ops, fingerprint = minimize(header, ops, budget=budget, log=log)
        seconds = time.monotonic() - start
    return {
        "bug": bug,
        "ops": len(ops),
        "step": step,
        "pool": f"{header.num_pages}x{header.page_size}",
        "min_ops": len(m_ops),
        "seconds": seconds,
        "fingerprint": fingerprint,
    }


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bugs", help="comma-separated bug names (default: the whole zoo)")
    parser.add_argument("--ops", type=int, default=1000, help="operations per trace (about)")
    parser.add_argument("--budget", type=float, default=60.0, help="the minimizer's budget in seconds")
    parser.add_argument("--rebuild", action="store_true", help="build the traces afresh")
    parser.add_argument("-v", "--verbose", action="store_true", help="the minimizer's log")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("kvledger").setLevel(logging.INFO if args.verbose else logging.WARNING)
    bugs = args.bugs.split(",") if args.bugs else sorted(BUGS)
    print(f"{'bug':30s} {'pool':>7s} {'ops':>5s} {'min':>4s} {'seconds':>7s}  fingerprint", flush=True)
    worst = 0.0
    over = []
    for bug in bugs:
        r = measure(bug, args.ops, args.budget, args.rebuild, args.verbose)
        worst = max(worst, r["seconds"])
        if r["min_ops"] > 10 or r["seconds"] >= args.budget:
            over.append(bug)
        print(
            f"{r['bug']:30s} {r['pool']:>7s} {r['ops']:5d} {r['min_ops']:4d} {r['seconds']:7.1f}  {r['fingerprint']}",
            flush=True,
        )
    print(
        f"slowest {worst:.1f}s; {len(bugs) - len(over)}/{len(bugs)} bugs at <= 10 ops within the budget"
        + (f" (not: {', '.join(over)})" if over else "")
    )
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
