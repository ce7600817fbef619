"""Rank 0's watch over the ranks it spawned, independent of the collectives.

The collectives alone notice a lost rank late or never: gloo fails a collective when a dead peer's
socket closes, but a stopped rank (SIGSTOP) keeps its sockets open and its peers wait for the
process group's timeout (minutes), and a rank that dies while rank 0 is idle is noticed at the next
step only. So a thread of rank 0 waits on three things at once (`multiprocessing.connection.wait`):
each rank's report pipe (a traceback when it raised), each rank's process sentinel (ready the
moment the process ends, whatever ended it), and a tick of TICK_SECONDS at which it reads each
rank's state in /proc and its heartbeat counter (engine/distributed/heartbeat.py). A rank stopped
by a signal (state T: SIGSTOP, SIGTSTP) for STOPPED_SECONDS is lost; the state says so directly, so
this need not wait long, and load cannot fake it. A counter that has stood still for STALL_SECONDS
is a lost rank too: frozen with its GIL held, stuck in the kernel, or stopped where /proc cannot be
read.

On the first failure the watch records it (`failure`, `failed`), SIGKILLs every rank still running
(a stopped one too: SIGKILL ends a stopped process) and reaps them, then calls `on_failure`. With
the peers' sockets closed, a collective rank 0 is blocked in fails at once, and rank 0 raises the
recorded error (engine/distributed/ranks.py: `RankProcesses.explain`). A rank that exits with
status 0 was told to shut down: that is no failure.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kvledger.engine.distributed.rank_errors import RankFailed, RankLost

log = logging.getLogger(__name__)

TICK_SECONDS = 0.1
STOPPED_SECONDS = 0.5  # stopped by a signal for this long: the rank is lost (a brief stop and SIGCONT is not)
STALL_SECONDS = 3.0  # a heartbeat that has not moved for this long: the rank is lost
REAP_SECONDS = 5.0


class RankWatch:
    """Watches ranks 1..N-1: `procs[i]`, `reports[i]` and `beats[i + 1]` are rank i + 1's."""

    def __init__(
        self,
        procs: Sequence[Any],
        reports: Sequence[Connection],
        beats: Any,
        on_failure: Callable[[RankFailed], None],
        leaving: Callable[[], bool] = lambda: False,
        stall_seconds: float = STALL_SECONDS,
    ) -> None:
        """`beats`: None where the ranks have no heartbeat (torchrun's: foreign_ranks.py);
        `leaving()`: whether rank 0 has told the ranks to shut down (their exits are no loss then)."""
        self._procs = list(procs)
        self._leaving = leaving
        self._reports: Dict[int, Optional[Connection]] = {r + 1: c for r, c in enumerate(reports)}
        self._beats = beats
        self._on_failure = on_failure
        self.stall_seconds = stall_seconds
        self.failure: Optional[RankFailed] = None
        self.failed = threading.Event()
        self._seen: Dict[int, Tuple[int, float]] = {}  # each rank's last heartbeat and when it moved
        self._stopped: Dict[int, float] = {}  # since when each stopped rank has been seen stopped
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvledger-tp-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the watch (before the ranks are joined or terminated on purpose)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)

    # -- the watch's thread ----------------------------------------------------------------------
    def _run(self) -> None:
        running = {r + 1: p for r, p in enumerate(self._procs)}
        self._seen = {rank: (self._beats[rank] if self._beats else 0, time.monotonic()) for rank in running}
        while not self._stop.is_set() and running and self.failure is None:
            waitables: List[Any] = [p.sentinel for p in running.values()]
            waitables += [c for r, c in self._reports.items() if c is not None and r in running]
            ready = set(wait(waitables, timeout=TICK_SECONDS))
            if self._stop.is_set():
                return
            for rank, proc in list(running.items()):
                reader = self._reports.get(rank)
                if reader is not None and reader in ready:
                    self._read(rank, reader)
                if proc.sentinel in ready:
                    del running[rank]
                    self._ended(rank, proc)
            now = time.monotonic()
            for rank, proc in running.items():
                self._check_silent(rank, proc, now)

    def _ended(self, rank: int, proc: Any) -> None:
        self._read(rank, self._reports.get(rank))  # a traceback sent just before it exited
        proc.join(REAP_SECONDS)  # the sentinel is ready a moment before the exit status
        if proc.exitcode != 0 and not self._leaving():
            self._fail(RankLost(rank, getattr(proc, "how_ended", None) or _exit_how(proc.exitcode)))

    def _check_silent(self, rank: int, proc: Any, now: float) -> None:
        """A running rank that is stopped, or whose heartbeat stands still, is lost."""
        if process_state(proc.pid) == "T":
            since = self._stopped.setdefault(rank, now)
            if now - since >= STOPPED_SECONDS:
                self._fail(RankLost(rank, f"stopped (SIGSTOP) for {now - since:.1f} s"))
        else:
            self._stopped.pop(rank, None)
        if self._beats is None:
            return
        beat, since = self._seen[rank]
        if self._beats[rank] != beat:
            self._seen[rank] = (self._beats[rank], now)
        elif now - since >= self.stall_seconds:
            self._fail(RankLost(rank, _stall_how(proc.pid, now - since)))

    def _read(self, rank: int, reader: Optional[Connection]) -> None:
        """Take every report waiting on `reader`; a "failed" one is the rank's failure."""
        while reader is not None:
            try:
                if not reader.poll():
                    return
                kind, detail = reader.recv()
            except (EOFError, OSError):  # the rank has exited and its end is closed
                self._reports[rank] = None
                return
            if kind == "failed":
                self._fail(RankFailed(rank, detail))

    def _fail(self, failure: RankFailed) -> None:
        if self.failure is not None:
            return
        self.failure = failure
        log.error("%s: killing the other ranks", failure if isinstance(failure, RankLost) else failure.args[0])
        kill_and_reap(self._procs)
        self.failed.set()
        self._on_failure(failure)


def kill_and_reap(procs: Sequence[Any]) -> None:
    """SIGKILL every process still running (stopped ones too) and wait for each to end."""
    for p in procs:
        if p.exitcode is None and p.pid is not None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.join(REAP_SECONDS)


def _exit_how(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _stall_how(pid: Optional[int], seconds: float) -> str:
    state = process_state(pid) if pid is not None else None
    if state in ("T", "t"):  # stopped by a signal (seen in between ticks), or by a debugger
        return f"stopped (state {state}), no heartbeat for {seconds:.1f} s"
    return f"no heartbeat for {seconds:.1f} s (process state {state or 'unknown'})"


def process_state(pid: int) -> Optional[str]:
    """The one-letter state of process `pid` in /proc (R, S, D, T, Z, ...); None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return fields[0] if fields else None
