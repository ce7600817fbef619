"""What a call-level step reads and writes in a subject's KV groups past the first (`View.groups`).

The call-level driver (`subject_driver.py`) allocates a batch, reads the batch's rows of every
group, then tells the subject each request was computed. Between the judge's last look and that
forward pass the allocation may have dropped positions of a window group (SGLang frees the SWA
slots that left the window inside `alloc_for_extend` / `alloc_for_decode`,
`ScheduleBatch.maybe_evict_swa`), and the judge's window clause, checked after the step, looks
only from the next position on. So the reads are judged here, on the rows the forward pass sees:
a request computing positions [start, end) attends, in a group of window W, to [start - W + 1,
start) before its own chunk, and each of those positions must hold KV written for exactly that
prefix (7-kv-provenance). The scheduling driver judges the same reads for a subject that
schedules itself (`scheduling_driver.py`).

It also reports the window's rare states the rows show (`subject_events.WINDOW_EVENTS`).
Its module loads only for a subject with KV groups (Hypothesis reads the literals of every
loaded module).
"""

from __future__ import annotations

from typing import Callable, Sequence, Tuple

from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.invariants import prefix_hashes
from kvledger.properties.subject import View
from kvledger.properties.subject_judge import Witness

__all__ = ["check_window_reads", "hit_step", "window_step"]

DROPPED = "window: positions dropped outside the window"
HIT = "window: a prefix hit in every group"


def check_window_reads(view: View, witness: Witness, uid: int, tokens: Sequence[int], start: int) -> None:
    """Finding 7-kv-provenance when a position the step at `start` reads in a window group (or
    a chunked-local one) does not hold KV of exactly its prefix (dropped, never written, or
    written for other tokens). Both drivers call it: the scheduling driver on the rows before the
    step, the call-level one on the rows after allocation."""
    hashes = prefix_hashes(tokens[:start])
    for n, group in enumerate(view.groups, 1):
        if group.window is None and group.chunk is None:
            continue
        row = group.requests.get(uid, [])
        for pos in range(group.first_read(start), start):
            loc = row[pos] if pos < len(row) else None
            found = None if loc is None else witness.written.get(int(loc))
            if found is None or found[0] != hashes[pos]:
                what = (
                    "was dropped"
                    if loc is None
                    else f"is at location {loc}, which "
                    + ("was never computed" if found is None else "holds KV computed for other tokens")
                )
                reach = f"window {group.window}" if group.chunk is None else f"chunk {group.chunk}"
                raise Finding(
                    "7-kv-provenance",
                    f"uid {uid}: the step computes position {start}, which reads position {pos} of "
                    f"KV group {n} ({group.name}, {reach}), but that position {what}",
                )


def window_step(
    rows: View, witness: Witness, batch: Sequence[Tuple[int, int, int]], on_event: Callable[[str], None]
) -> None:
    """Judge what each request of the batch reads in the window groups (`rows`: the batch's rows,
    read after allocation and before the forward pass), and report the rows' window states."""
    for uid, start, _ in batch:
        check_window_reads(rows, witness, uid, witness.tokens[uid], start)
    if any(None in row for g in rows.groups for row in g.requests.values()):
        on_event(DROPPED)


def hit_step(uid: int, hit: int, after: View, on_event: Callable[[str], None]) -> None:
    """An admission with a prefix hit of `hit` tokens: 'a prefix hit in every group' when every
    group holds the hit where the next position reads it (a window group: [hit - W + 1, hit))."""
    for group in after.groups:
        row = group.requests.get(uid, [])
        low = group.first_read(hit)
        if len(row) < hit or any(loc is None for loc in row[low:hit]):
            return
    if hit and after.groups:
        on_event(HIT)
