"""`kvledger replay TRACE`: run a trace on reference and fast in lockstep and report."""

from __future__ import annotations

import sys

from kvledger.engine.ledger.cache_scheduler import InvalidOp
from kvledger.engine.ledger.trace import TraceError, read
from kvledger.properties.lockstep import Finding, replay


def replay_file(path: str, device: str = "cpu", bug: str | None = None) -> int:
    """Exit 0 when both agree, 1 on a divergence, 2 on a bad trace, an invalid op or an unknown bug.
    `bug` patches a zoo bug into fast first (to watch a regression trace catch it)."""
    from kvledger.subjects.fast_zoo import patched

    try:
        header, ops = read(path)
    except (OSError, TraceError) as e:
        print(f"kvledger replay: {e}", file=sys.stderr)
        return 2
    try:
        with patched(bug):
            lock = replay(header, ops, device=device)
    except KeyError as e:
        print(f"kvledger replay: {e.args[0]}", file=sys.stderr)
        return 2
    except InvalidOp as e:
        print(f"kvledger replay: {path}: operation {e.step} is invalid at that point: {e}", file=sys.stderr)
        return 2
    except Finding as e:
        print(f"DIVERGED at step {e.step} ({(e.op or {}).get('op')}): {e.kind}")
        print(f"  operation: {e.op}")
        print(f"  {e.message}")
        return 1
    ref = lock.ref
    admission = header.admission + (f" (reserve_ratio {header.reserve_ratio})" if ref.policy.preempts else "")
    print(
        f"OK: {len(ops)} operations agree on reference and fast ({header.cache_type} cache, page size "
        f"{header.page_size}, {header.num_pages} pages, {admission} admission); live requests at the end: "
        f"{len(ref.live)}, free pages: {len(ref.cm.free_slots)}, cached tokens: "
        f"{ref.cm.prefix_cache.size_info.total_size}; preemptions: {ref.preemptions}, recomputed tokens: "
        f"{ref.recomputed_tokens}"
    )
    return 0
