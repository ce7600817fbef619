"""Measure what isolation costs a target: the fuzzer's first cases of a seed, played in this process
and then through the sandbox (one child for all of them, as a fuzz worker runs its cases), in
alternating rounds; then the write-ahead record's cost per operation and a fork's.

    python -m kvledger.checker.audit.isolation_bench [--subject SPEC] [--cases 20] [--rounds 3]

Without --subject it measures reference against fast. The cases are the same in every round (seed
0, worker 0 of 1), so a round's ops/s compares like with like; this machine's spread between rounds
is the noise to read the difference against. Wall time is measured, never decided on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from kvledger.checker import sandbox
from kvledger.checker.fuzz_case import Workload, play_case
from kvledger.checker.isolated_runs import Cases
from kvledger.engine.ledger.ops import Decode, Prefill, Submit, written
from kvledger.engine.ledger.trace import Header
from kvledger.properties import write_ahead
from kvledger.properties.isolation import ISOLATED


def _rate(play: Callable[[int, int], Any], workload: Workload, cases: int) -> float:
    ops, start = 0, time.perf_counter()
    for k in range(cases):
        ops += len(play(k, workload.case_seed(0, 0, 1, k)).ops)
    return ops / (time.perf_counter() - start)


def rounds(target: Any, cases: int, n: int) -> Dict[str, List[float]]:
    """ops/s per round: "in process" and "isolated" (one sandboxed child for the round's cases)."""
    from kvledger.checker.workloads import workload_for

    workload = workload_for(target)
    workload.prepare()
    out: Dict[str, List[float]] = {"in process": [], "isolated": []}
    with target.active():
        for _ in range(n):
            out["in process"].append(_rate(lambda k, s: play_case(workload, k, s), workload, cases))
            with Cases(workload, ISOLATED) as isolated:
                out["isolated"].append(_rate(isolated, workload, cases))
    return out


def record_cost(calls: int = 100_000) -> Dict[str, float]:
    """Microseconds per `write_ahead.before`, with no record open and with one."""
    header = Header(num_pages=64, page_size=16, cache_type="radix", table_slots=8, max_seq_len=512)
    ops = [written(Submit(1, tuple(range(40)), 8)), written(Prefill(64, (3,))), written(Decode((1, 2, 3, 4)))]
    owner: object = object()

    def per_call() -> float:
        start = time.perf_counter()
        for i in range(calls):
            write_ahead.before(owner, lambda: header, (), ops[i % 3])
        return (time.perf_counter() - start) / calls * 1e6

    closed = min(per_call() for _ in range(3))
    with tempfile.TemporaryDirectory() as folder:
        write_ahead.open_log(os.path.join(folder, "record.jsonl"))
        try:
            opened = min(per_call() for _ in range(3))
        finally:
            write_ahead.close()
    return {"closed": closed, "open": opened}


def fork_cost(calls: int = 20) -> float:
    """Milliseconds per `sandbox.call` of a no-op from this process (a fork, a pipe, a reap)."""
    start = time.perf_counter()
    for _ in range(calls):
        sandbox.call(ISOLATED, lambda: None)
    return (time.perf_counter() - start) / calls * 1e3


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvledger.checker.audit.isolation_bench", description=__doc__)
    p.add_argument("--subject", default=None, help="a subject spec (default: reference against fast)")
    p.add_argument("--cases", type=int, default=20, help="the seed's first cases, per round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    import torch

    from kvledger.checker.targets import target_for

    torch.set_num_threads(1)  # as a fuzz worker runs
    target = target_for(args.subject)
    result = rounds(target, args.cases, args.rounds)
    for name, rates in result.items():
        cells = ", ".join(f"{r:,.0f}" for r in rates)
        print(f"{target.name} {name:>10}: median {statistics.median(rates):,.0f} ops/s ({cells})")
    cost = record_cost()
    print(f"write-ahead record: {cost['open']:.2f} us per operation ({cost['closed']:.2f} with none open)")
    print(f"a child (fork, answer, reap) from this process: {fork_cost():.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
