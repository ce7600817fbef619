"""The trace recorder: writes every operation the engine performs as one line of a trace
(`trace.py`), flushed as it goes so a crashed run leaves its trace behind."""

from __future__ import annotations

import json
from typing import IO

from kvledger.engine.ledger.observer import LedgerState
from kvledger.engine.ledger.ops import OpRecord
from kvledger.engine.ledger.trace import Header, dumps


class TraceRecorder:
    needs_state = False

    def __init__(self, path: str, header: Header) -> None:
        self._file: IO[str] = open(path, "w")
        self._file.write(dumps(header, []))
        self._file.flush()

    def __call__(self, step: int, record: OpRecord, state: LedgerState) -> None:
        self._file.write(json.dumps(record.to_json(), separators=(", ", ": ")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
