"""The fault facility's rank kinds on a tensor-parallel rank: `rank-kill@step=N,rank=R` and
`rank-stop@step=N,rank=R` (engine/runtime/faults.py; `--inject-fault` or $KVLEDGER_INJECT_FAULT).

Every rank reads the same spec and counts the same steps (each step the ranks take together,
from 1); at step N rank R sends itself SIGKILL or SIGSTOP before its share of the step, so its peers
are left inside the step's collectives, as with a rank the OOM killer or an operator takes out
mid-request. Rank 0 is the server's own process: killing it ends the server and its ranks then
leave (engine/distributed/heartbeat.py); stopping it freezes the server whole, for an outside probe
to see. How rank 0 notices the others: engine/distributed/rank_watch.py.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any, Optional

from kvledger.engine.runtime.faults import RANK_KILL, RANK_KINDS, RANK_STOP, FaultPlan

log = logging.getLogger(__name__)


class RankFaults:
    def __init__(self, plan: FaultPlan, rank: int, size: int) -> None:
        for fault in plan.faults:
            if fault.kind in RANK_KINDS and fault.rank is not None and fault.rank >= size:
                raise ValueError(f"inject_fault: {fault} names rank {fault.rank}, but the ranks are 0..{size - 1}")
        self.plan, self.rank = plan, rank

    @classmethod
    def for_engine(cls, engine: Any, rank: int, size: int) -> Optional[RankFaults]:
        """The rank faults of the engine's fault spec; None when it plans none."""
        spec = getattr(engine.config, "inject_fault", None)
        plan = FaultPlan.parse(spec) if spec else None
        if plan is None or not plan.kinds & RANK_KINDS:
            return None
        return cls(plan, rank, size)

    def before_step(self, step: int) -> None:
        """Strike this rank if a rank fault for it is due at `step` (every rank counts every fault)."""
        for kind, sig in ((RANK_KILL, signal.SIGKILL), (RANK_STOP, signal.SIGSTOP)):
            while (fault := self.plan.due(kind, step)) is not None:
                if fault.rank != self.rank:
                    continue
                log.warning("injected fault %s: rank %d sends itself %s at step %d", fault, self.rank, sig.name, step)
                for handler in logging.getLogger().handlers:  # the line out before the process goes
                    handler.flush()
                os.kill(os.getpid(), sig)
