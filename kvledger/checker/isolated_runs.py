"""Replays and fuzz cases of a target through the sandbox (`sandbox.py`), for the commands that
run them one at a time: the minimizers' candidates, `kvledger replay`, the pytest entry point's
cases. A target whose `isolation` is off runs them in this process, as before.

Each call is one child: a candidate that kills its process ends only that child, and the death
comes back as the finding it is (`subject-crashed:SIGSEGV`, ...), so a minimizer keeps a
candidate that dies the same way as the trace it shrinks.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from kvledger.checker import sandbox
from kvledger.checker.fuzz_case import OP_LIMIT_S, CaseOutcome, Workload, play_case
from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import OpRecord, TraceLine
from kvledger.engine.ledger.trace import Header
from kvledger.properties.isolation import Isolation
from kvledger.properties.target import Target, applied, replay

__all__ = ["died_outcome", "play_case_isolated", "replay_isolated"]


def replay_isolated(
    target: Target, header: Header, ops: Sequence[TraceLine]
) -> Tuple[Optional[Finding], Optional[List[OpRecord]]]:
    """`properties.target.replay` in the target's sandbox: the first finding (a death included) and
    the operations applied (None: the run was never built). InvalidOp of a strict target and
    SubjectUnavailable propagate as they do in process."""
    try:
        finding, ops_applied, version = sandbox.call(target.isolation, _replay_here, target, header, ops)
    except sandbox.SubjectDied as died:
        return died, list(died.ops)
    if version is not None:  # a subject target learns its version from the subject it built
        target.version = version  # type: ignore[attr-defined]
    return finding, ops_applied


def _replay_here(target: Target, header: Header, ops: Sequence[TraceLine]) -> Tuple[Optional[Finding], Any, Any]:
    finding, run = replay(target, header, ops)
    return finding, None if run is None else applied(run), getattr(target, "version", None)


def play_case_isolated(
    workload: Workload, isolation: Isolation, number: int, cseed: int, op_limit: float = OP_LIMIT_S
) -> CaseOutcome:
    """`fuzz_case.play_case` in a child under `isolation`; a death is the case's finding."""
    try:
        return sandbox.call(isolation, play_case, workload, number, cseed, lambda: True, op_limit)
    except sandbox.SubjectDied as died:
        return died_outcome(workload, number, cseed, died)


def died_outcome(workload: Workload, number: int, cseed: int, died: sandbox.SubjectDied) -> CaseOutcome:
    """The case whose child died: its pool, the operations up to the one in flight, the death as
    its finding."""
    return CaseOutcome(
        number, cseed, workload.header(cseed), list(died.ops), finding=died, steps=max(len(died.ops) - 1, 0)
    )
