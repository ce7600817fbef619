"""Watchers of the engine's cache operations: a trace recorder and the shadow verifier.

Both see the same stream of driver operations (see `engine/ledger/cache_scheduler.py`) the engine performs on
`fast`: the recorder writes them as a trace, the shadow applies each to the `reference` model and
compares the full ownership state after each one.
"""

from __future__ import annotations

import json
from typing import IO, Dict

from kvledger import reference
from kvledger.engine.ledger.cache_scheduler import CacheScheduler, InvalidOp, InvariantViolation
from kvledger.engine.ledger.divergence import Divergence, compare
from kvledger.engine.ledger.trace import Header, dumps


class TraceRecorder:
    def __init__(self, path: str, header: Header) -> None:
        self._file: IO[str] = open(path, "w")
        self._file.write(dumps(header, []))
        self._file.flush()

    def __call__(self, step: int, op: Dict, engine_driver: CacheScheduler) -> None:
        self._file.write(json.dumps(op, separators=(", ", ": ")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class FrozenState:
    """A driver's invariant check and full snapshot, taken right after an operation, for an
    observer told of the operation later (with overlap, once the step's tokens are known)."""

    def __init__(self, driver: CacheScheduler) -> None:
        self.error: InvariantViolation | None = None
        try:
            driver.check()
        except InvariantViolation as e:
            self.error = e
        self._snapshot = driver.snapshot()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def snapshot(self) -> Dict:
        return self._snapshot


class ShadowDivergence(RuntimeError):
    def __init__(self, step: int, op: Dict, kind: str, detail: str) -> None:
        super().__init__(f"shadow verification failed at step {step}, operation {op.get('op')} "
                         f"({json.dumps(op)[:300]}): {kind}: {detail}")
        self.step, self.op, self.kind, self.detail = step, op, kind, detail


class ShadowVerifier:
    """Mirrors every cache operation into the reference model and compares after each."""

    # compares the engine's state right after each operation: the scheduler freezes that state
    # (FrozenState) when the operation's tokens are still on the GPU (see engine/runtime/scheduler.py)
    needs_state = True

    def __init__(self, header: Header) -> None:
        self.model = CacheScheduler(reference, **header.driver_args())
        self.steps = 0

    def __call__(self, step: int, op: Dict, engine_driver: CacheScheduler) -> None:
        try:
            result = self.model.apply(op)
            expect = op.get("expect")
            if expect is not None and {k: result.get(k) for k in expect} != expect:
                raise Divergence(step, op, f"result:{op['op']}", f"engine {expect}, reference {result}")
            compare(self.model, engine_driver, step, op)
        except Divergence as e:
            raise ShadowDivergence(step, op, e.kind, e.detail) from e
        except InvalidOp as e:
            raise ShadowDivergence(step, op, "invalid-op", str(e)) from e
        self.steps += 1

    def close(self) -> None:
        pass
