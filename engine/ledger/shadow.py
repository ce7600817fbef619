"""The shadow verifier (`--verify`): every operation the engine performs on `fast` is applied to
the `reference` model too, and the two full ownership states are compared after each one. The
first difference raises a `Finding` (`finding.py`) naming the step and the operation."""

from __future__ import annotations

from kvledger import reference
from kvledger.engine.ledger.cache_scheduler import CacheScheduler, InvalidOp
from kvledger.engine.ledger.divergence import compare
from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.observer import LedgerState
from kvledger.engine.ledger.ops import OpRecord
from kvledger.engine.ledger.trace import Header

WHY = "shadow verification failed"


class ShadowVerifier:
    needs_state = True

    def __init__(self, header: Header) -> None:
        self.model = CacheScheduler(reference, **header.cache_scheduler_args())
        self.steps = 0

    def __call__(self, step: int, record: OpRecord, state: LedgerState) -> None:
        line = record.to_json()
        try:
            result = self.model.apply(record.op)
            if record.expect is not None:
                expect = record.expect.as_dict()
                if not result.matches(expect):
                    seen = result.seen(expect)
                    raise Finding(f"result:{record.name}", f"engine {expect}, reference {seen}", step=step, op=line)
            compare(self.model, state, step, line)
        except Finding as e:
            raise Finding(e.kind, f"{WHY}: {e.message}", e.detail, step, line) from e
        except InvalidOp as e:
            raise Finding("invalid-op", f"{WHY}: {e}", step=step, op=line) from e
        self.steps += 1

    def close(self) -> None:
        pass
