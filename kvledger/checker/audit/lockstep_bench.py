"""The lockstep harness's throughput: operations per second of a random workload on reference and
fast, their states compared after each (printed by `kvledger bench cache` after the cache manager's
own figures). Prints numbers; asserts nothing."""

from __future__ import annotations

import random
import time
from typing import List

from kvledger.engine.ledger.trace import Header
from kvledger.properties.lockstep import Lockstep


def random_ops(seed: int, n: int) -> List[dict]:
    rng = random.Random(seed)
    ops, uid = [], 0
    for _ in range(n):
        r = rng.random()
        if r < 0.25:
            base = [rng.randrange(3)] * rng.randrange(1, 30)
            ops.append(
                {
                    "op": "submit",
                    "uid": uid,
                    "tokens": base + [rng.randrange(4) for _ in range(rng.randrange(4))],
                    "max_tokens": rng.randrange(1, 16),
                }
            )
            uid += 1
        elif r < 0.5:
            ops.append({"op": "prefill", "budget": rng.choice([4, 16, 64]), "sample": [rng.randrange(4)]})
        else:
            ops.append({"op": "decode", "sample": [rng.randrange(4)]})
    return ops


def harness_ops_per_second(seconds: float = 3.0) -> float:
    done, start, seed = 0, time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        lock = Lockstep(Header(num_pages=48, page_size=4, cache_type="radix", table_slots=8, max_seq_len=256))
        for op in random_ops(seed, 300):
            if op["op"] == "decode" and not lock.ref.dm.runnable:
                continue
            lock.apply(op)
            done += 1
        seed += 1
    return done / (time.perf_counter() - start)


def main() -> None:
    print(f"lockstep harness: {harness_ops_per_second():,.0f} operations/s (both sides, state compared after each)")
