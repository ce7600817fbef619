"""A spawned rank's sign of life, independent of the collectives: a counter in shared memory that a
daemon thread bumps every HEARTBEAT_SECONDS.

A rank that is stopped (SIGSTOP, a debugger) or frozen with the GIL held keeps its sockets open, so
its peers' collectives just wait; only the counter standing still shows it (rank 0 reads it:
engine/distributed/rank_watch.py). The same thread ends the rank when rank 0's process is gone
(its parent changed), so a rank never outlives the engine it served, whatever killed rank 0.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

HEARTBEAT_SECONDS = 0.1


def start_heartbeat(beats: Any, rank: int, parent: int) -> threading.Thread:
    """Bump `beats[rank]` (a shared array of unsigned counters) from a daemon thread of this process;
    leave at once (exit status 1) when process `parent` (rank 0) is no longer this one's parent."""

    def beat() -> None:
        while True:
            beats[rank] += 1
            if os.getppid() != parent:  # rank 0 died (the process was re-parented): nobody to serve
                os._exit(1)
            time.sleep(HEARTBEAT_SECONDS)

    thread = threading.Thread(target=beat, name=f"kvledger-rank{rank}-heartbeat", daemon=True)
    thread.start()
    return thread
