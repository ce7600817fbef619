"""Replays and fuzz cases of a target through the sandbox (`sandbox.py`), for the commands that
run them one at a time: the minimizers' candidates, `kvledger replay`, the pytest entry point's
cases. A target whose `isolation` is off runs them in this process, as before.

A `Replayer` (and a `Cases`) keeps one child for all its replays and forks a fresh one only after a
death, so a minimizer pays a fork per candidate that kills its process, not per candidate. The
death comes back as the finding it is (`subject-crashed:SIGSEGV`, ...), so a minimizer keeps a
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

__all__ = ["Cases", "Replayer", "died_outcome", "replay_isolated"]

Replayed = Tuple[Optional[Finding], Optional[List[OpRecord]]]


class Replayer:
    """`properties.target.replay` on `target`, in its sandbox: each call returns the first finding
    (a death included) and the operations applied (None: the run was never built). InvalidOp of
    a strict target and SubjectUnavailable propagate as they do in process."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.server = sandbox.Server(target.isolation, self._here)
        self.replays = 0

    def __call__(self, header: Header, ops: Sequence[TraceLine]) -> Replayed:
        self.replays += 1
        try:
            finding, ops_applied, version = self.server(header, list(ops))
        except sandbox.SubjectDied as died:
            return died, list(died.ops)
        if version is not None:  # a subject target learns its version from the subject it built
            self.target.version = version  # type: ignore[attr-defined]
        return finding, ops_applied

    def _here(self, header: Header, ops: Sequence[TraceLine]) -> Tuple[Optional[Finding], Any, Any]:
        finding, run = replay(self.target, header, ops)
        return finding, None if run is None else applied(run), getattr(self.target, "version", None)

    def close(self) -> None:
        self.server.close()

    def __enter__(self) -> Replayer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def replay_isolated(target: Target, header: Header, ops: Sequence[TraceLine]) -> Replayed:
    """One replay in a child of its own (see `Replayer`)."""
    with Replayer(target) as replayer:
        return replayer(header, ops)


class Cases:
    """Fuzz cases of `workload` under `isolation`, one child for all of them until one dies: each
    call plays case `number` of seed `cseed` and returns its outcome, a death as its finding."""

    def __init__(self, workload: Workload, isolation: Isolation, op_limit: float = OP_LIMIT_S) -> None:
        self.workload, self.op_limit = workload, op_limit
        self.server = sandbox.Server(isolation, self._here)

    def __call__(self, number: int, cseed: int) -> CaseOutcome:
        try:
            outcome: CaseOutcome = self.server(number, cseed)
            return outcome
        except sandbox.SubjectDied as died:
            return died_outcome(self.workload, number, cseed, died)

    def _here(self, number: int, cseed: int) -> CaseOutcome:
        return play_case(self.workload, number, cseed, lambda: True, self.op_limit)

    def close(self) -> None:
        self.server.close()

    def __enter__(self) -> Cases:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def died_outcome(workload: Workload, number: int, cseed: int, died: sandbox.SubjectDied) -> CaseOutcome:
    """The case whose child died: its pool, the operations up to the one in flight, the death as
    its finding."""
    ops = list(died.ops)
    return CaseOutcome(number, cseed, workload.header(cseed), ops, finding=died, steps=max(len(ops) - 1, 0))
