"""The one failure type of the checker: what broke, where, and how.

Lockstep (reference against fast), judge mode (one subject) and the engine's shadow verifier
(`--verify`) all raise a `Finding`. Its `kind` is the fingerprint the minimizer keeps and the zoo
counts: `invariant:<name>`, `state:<field>`, `result:<op>`, `expect:<op>`, `fast-raised:<exception>`
in lockstep; an invariant's name or `subject-raised:<exception>` in judge mode. It lives in
`engine/ledger` because the shadow verifier raises it and the engine imports nothing of the checker.
"""

from __future__ import annotations

from typing import Any, Dict, Optional


class Finding(AssertionError):
    """A bug found: `kind` (the fingerprint), `message` (what differed or broke), `detail` (""
    or a traceback), `step` (the 1-based index of the failing operation, None where unknown) and
    `op` (that operation's trace line, None where unknown)."""

    def __init__(
        self,
        kind: str,
        message: str,
        detail: str = "",
        step: Optional[int] = None,
        op: Optional[Dict[str, Any]] = None,
    ) -> None:
        super().__init__(kind, message, detail, step, op)  # args: a Finding pickles across processes
        self.kind = kind
        self.message = message
        self.detail = detail
        self.step = step
        self.op = op

    @property
    def fingerprint(self) -> str:
        return self.kind

    def at(self, step: int, op: Dict[str, Any]) -> Finding:
        """This finding placed at operation `step` (1-based) of a run, unless it already is."""
        if self.step is None:
            self.step, self.op = step, op
            self.args = (self.kind, self.message, self.detail, step, op)
        return self

    def __str__(self) -> str:
        if self.step is None:
            return f"[{self.kind}] {self.message}"
        return f"step {self.step}, op {self.op}: {self.kind}: {self.message}"
