"""Do the ranks agree? The cross-rank check of the cache scheduler's state (`--verify` under tensor parallelism).

Each rank hashes its cache-side state (the same snapshot the shadow verifier compares: owners,
page-table rows, token pool, queues) after every cache operation. After every step the ranks
all-gather their lists of (operation number, hash); the first operation whose hashes differ stops
the run on every rank, naming the operation and the ranks that disagree with rank 0."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, List, Optional, Tuple

from kvledger.engine.distributed.group import TensorParallelGroup
from kvledger.engine.ledger.observer import LedgerState
from kvledger.engine.ledger.ops import OpRecord


class RankDisagreement(RuntimeError):
    def __init__(self, step: Optional[int], op: Dict[str, Any], ranks: List[int], hashes: List[str]) -> None:
        # step None: rank 0 performed no operation where another rank did
        shown = ", ".join(f"rank {r}: {h[:12]}" for r, h in enumerate(hashes))
        super().__init__(
            f"tensor-parallel ranks {ranks} disagree with rank 0 after cache operation {step} "
            f"({json.dumps(op)[:300]}): state hashes {shown}"
        )
        self.step, self.op, self.ranks, self.hashes = step, op, ranks, hashes


def state_hash(snapshot: Dict[str, Any]) -> str:
    return hashlib.sha256(repr(snapshot).encode()).hexdigest()


class RankAgreement:
    """A scheduler observer: hashes the state after each operation; `compare` after each step."""

    needs_state = True  # with overlap, the state right after the operation (see engine/ledger/observer.py)

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self._pending: List[Tuple[int, OpRecord, str]] = []
        self.operations = 0  # how many were compared across ranks

    def __call__(self, step: int, record: OpRecord, state: LedgerState) -> None:
        self._pending.append((step, record, state_hash(state.snapshot())))

    def compare(self) -> None:
        """All-gather every rank's hashes since the last call; raise RankDisagreement at the first
        operation where any rank differs from rank 0."""
        mine, self._pending = self._pending, []
        everyone = self.group.all_gather([(step, h) for step, _, h in mine])
        for i in range(max(len(ranks_ops) for ranks_ops in everyone)):
            at = [ops[i] if i < len(ops) else (None, "missing") for ops in everyone]
            differ = [r for r, entry in enumerate(at) if entry != at[0]]
            if differ:
                step, op = (mine[i][0], mine[i][1].to_json()) if i < len(mine) else (at[0][0], {})
                raise RankDisagreement(step, op, differ, [h for _, h in at])
        self.operations += len(mine)
