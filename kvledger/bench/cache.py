"""`kvledger bench cache`: how much the cache manager costs. Prints numbers; asserts nothing.

1. Cache work per decode step at batch 256 (allocate_paged, complete_one, the reservation sum,
   result processing in a lazy-free region), page sizes 1 and 16, fast and reference.
2. Radix eviction of one page with 1k, 8k and 64k cached pages.
3. Lockstep harness throughput: operations per second of a random workload on both sides.
"""

from __future__ import annotations

import random
import time
from typing import Callable, List

from kvledger import fast, reference
from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.engine.ledger.trace import Header
from kvledger.properties.lockstep import Lockstep


def _timeit(fn: Callable[[], None], repeat: int) -> float:
    fn()  # warm up
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def decode_step_cost(impl, page_size: int, batch: int = 256, steps: int = 200) -> float:
    d = CacheScheduler(
        impl,
        num_pages=batch * (64 + steps) // page_size + batch,
        page_size=page_size,
        cache_type="radix",
        table_slots=batch,
        max_seq_len=64 + steps + 8,
        track_provenance=False,
    )
    for uid in range(batch):
        d.submit(uid, [uid % 7] * 8 + [uid] * 56, steps + 4)
    while d.waiting:
        d.prefill(16384)
    start = time.perf_counter()
    for _ in range(steps):
        d.decode([1])
    return (time.perf_counter() - start) / steps


def eviction_cost(impl, pages: int, repeat: int = 50) -> float:
    cache = impl.RadixPrefixCache(1)
    ids = (lambda xs: xs) if impl is reference else (lambda xs: fast.requests.as_token_tensor(xs))
    for i in range(pages):  # distinct two-token keys: a wide tree of single-page leaves
        cache.insert_prefix(ids([i // 4096, i % 4096]), ids([2 * i, 2 * i + 1]))
    start = time.perf_counter()
    for _ in range(repeat):
        cache.evict(1)
    return (time.perf_counter() - start) / repeat


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
    print("cache work per decode step, batch 256 (radix cache)")
    for ps in (1, 16):
        for impl in (fast, reference):
            print(f"  page_size {ps:>2}  {impl.__name__:<9} {decode_step_cost(impl, ps) * 1e3:8.3f} ms/step")
    print("radix eviction of one page")
    for pages in (1_000, 8_000, 64_000):
        for impl in (fast, reference):
            repeat = 50 if impl is fast else max(3, 50_000 // pages)
            cost = eviction_cost(impl, pages, repeat) * 1e6
            print(f"  {pages:>6} cached pages  {impl.__name__:<9} {cost:10.1f} us/evict")
    print(f"lockstep harness: {harness_ops_per_second():,.0f} operations/s (both sides, state compared after each)")
