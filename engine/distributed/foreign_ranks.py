"""The ranks of a torchrun world as rank 0 can watch them: processes it did not spawn.

Under torchrun no rank is rank 0's child, so there is no multiprocessing sentinel and no shared
heartbeat. When every rank runs on rank 0's host (`--standalone`, or one node), rank 0 still learns
each rank's pid (one all-gather at startup) and watches it as rank_watch.py watches its own
children: a pidfd (Linux 5.3) is ready when the process ends, whoever ends it, and /proc shows it
stopped. What it cannot see: a rank frozen while running (no heartbeat here), and the exit status
(the process is torchrun's to reap). Across hosts nothing of this applies.
"""

from __future__ import annotations

import os
import select
import socket
from typing import Any, List, Optional

from kvledger.engine.distributed.group import TensorParallelGroup


class ForeignRank:
    """A process handle for a rank on this host that rank 0 did not spawn, shaped like the
    multiprocessing.Process the watch reads (pid, sentinel, exitcode, is_alive, join)."""

    how_ended = "ended (torchrun's process: its exit status is not rank 0's to read)"

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)
        self._ended = False

    @property
    def exitcode(self) -> Optional[int]:
        """None while it runs; 1 once it has ended (the true status is torchrun's)."""
        return 1 if self._ended or self.join(0.0) else None

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: Optional[float] = None) -> bool:
        """Wait up to `timeout` seconds for it to end; whether it has."""
        if not self._ended:
            ready, _, _ = select.select([self.sentinel], [], [], timeout)
            self._ended = bool(ready)
        return self._ended


def torchrun_peers(group: TensorParallelGroup) -> Optional[List[Any]]:
    """Every rank calls this once after joining (it is a collective). On rank 0: handles for ranks
    1..N-1 when all run on this host, else None; on the other ranks: None."""
    everyone = group.all_gather((socket.gethostname(), os.getpid()))
    if group.rank != 0 or not hasattr(os, "pidfd_open"):
        return None
    host = everyone[0][0]
    if any(h != host for h, _ in everyone):
        return None
    try:
        return [ForeignRank(pid) for _, pid in everyone[1:]]
    except OSError:  # a rank already gone (its next collective will say so), or no pidfds here
        return None
