"""How a tensor-parallel run ends when a rank other than 0 does: the errors rank 0 raises.

`RankFailed`: the rank raised, and its traceback reached rank 0. `RankLost`: the rank went without
a word, killed (SIGKILL, the OOM killer), stopped (SIGSTOP) or otherwise silent, as rank 0's
liveness watch saw it (engine/distributed/rank_watch.py). A lost rank is a failed one, so code that
catches RankFailed catches both.
"""

from __future__ import annotations


class RankFailed(RuntimeError):
    def __init__(self, rank: int, detail: str) -> None:
        lines = [line for line in detail.strip().splitlines() if line.strip()]
        summary = lines[-1] if lines else "no detail"  # the exception's own line ends a traceback
        super().__init__(f"tensor-parallel rank {rank} failed: {summary}\n{detail}")
        self.rank, self.detail = rank, detail


class RankLost(RankFailed):
    """Rank `rank` is gone or stopped answering; `how` says what rank 0 saw ("killed by SIGKILL",
    "stopped (SIGSTOP)", "no heartbeat for 2.0 s", "exited with code 1")."""

    def __init__(self, rank: int, how: str) -> None:
        RuntimeError.__init__(self, f"tensor-parallel rank {rank} lost: {how}")
        self.rank, self.detail, self.how = rank, how, how
