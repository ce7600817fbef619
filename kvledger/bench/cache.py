"""`kvledger bench cache`: how much the cache manager costs. Prints numbers; asserts nothing.

1. Cache work per decode step at batch 256 (allocate_paged, complete_one, the reservation sum,
   result processing in a lazy-free region), page sizes 1 and 16, fast and reference.
2. Radix eviction of one page with 1k, 8k and 64k cached pages.
The lockstep harness's own throughput is the checker's (kvledger/checker/audit/lockstep_bench.py).
"""

from __future__ import annotations

import time
from typing import Callable

from kvledger import fast, reference
from kvledger.engine.ledger.cache_scheduler import CacheScheduler


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
