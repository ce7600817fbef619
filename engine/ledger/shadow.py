"""The shadow verifier (`--verify`): every operation the engine performs on `fast` is applied to
the `reference` model too, and the two full ownership states are compared after each one."""

from __future__ import annotations

import json
from typing import Dict

from kvledger import reference
from kvledger.engine.ledger.cache_scheduler import CacheScheduler, InvalidOp
from kvledger.engine.ledger.divergence import Divergence, compare
from kvledger.engine.ledger.observer import LedgerState
from kvledger.engine.ledger.ops import OpRecord
from kvledger.engine.ledger.trace import Header


class ShadowDivergence(RuntimeError):
    def __init__(self, step: int, op: Dict, kind: str, detail: str) -> None:
        super().__init__(
            f"shadow verification failed at step {step}, operation {op.get('op')} "
            f"({json.dumps(op)[:300]}): {kind}: {detail}"
        )
        self.step, self.op, self.kind, self.detail = step, op, kind, detail


class ShadowVerifier:
    needs_state = True

    def __init__(self, header: Header) -> None:
        self.model = CacheScheduler(reference, **header.cache_scheduler_args())
        self.steps = 0

    def __call__(self, step: int, record: OpRecord, state: LedgerState) -> None:
        try:
            result = self.model.apply(record.op)
            if record.expect is not None:
                expect = record.expect.as_dict()
                if {k: result.get(k) for k in expect} != expect:
                    raise Divergence(
                        step, record.to_json(), f"result:{record.name}", f"engine {expect}, reference {result}"
                    )
            compare(self.model, state, step, record.to_json())
        except Divergence as e:
            raise ShadowDivergence(step, record.to_json(), e.kind, e.detail) from e
        except InvalidOp as e:
            raise ShadowDivergence(step, record.to_json(), "invalid-op", str(e)) from e
        self.steps += 1

    def close(self) -> None:
        pass
