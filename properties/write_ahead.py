"""The write-ahead record: every operation is written down before it is applied.

A subject can kill its process (a segfault in a native core, `os._exit`, an out-of-memory kill) or
hang where no signal reaches it. The checker runs such work in a child process
(`kvledger/checker/sandbox.py`) that opens this record first; when the child dies, the record
holds the exact sequence that killed it, and the parent turns it into a finding with its trace.

The record is a trace file (`engine/ledger/trace.py`'s format): the header of the run being
applied and its operations so far, the last one the operation in flight. Whenever another run
starts applying (a fresh subject for the next case, a copy made by `kvledger explore`), the file
is rewritten with that run's header and the operations it already has, so it never holds more
than one run. Each line is one unbuffered `write`: once it returns, the kernel has it, and a
death of the process cannot take it back. With no record open (the default) `before` costs one
comparison.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple, TypeVar

from kvledger.engine.ledger.ops import InvalidOp, OpRecord
from kvledger.engine.ledger.trace import Header, dumps, loads

__all__ = ["WriteAheadLog", "before", "close", "last_sequence", "open_log", "recorded", "starting", "undo"]


class WriteAheadLog:
    """One process's record, at `path` (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self._owner: object = None  # the run whose sequence the file holds (kept alive: ids are reused)
        self._size = 0  # bytes in the file
        self._before_last = 0  # its size before the last operation's line

    def begin(self, owner: object, header: Header, prior: Sequence[OpRecord] = ()) -> None:
        """The file holds `owner`'s run from now on: its header and the operations it has applied."""
        os.ftruncate(self._fd, 0)
        text = dumps(header, prior).encode()
        os.write(self._fd, text)
        self._owner, self._size, self._before_last = owner, len(text), len(text)

    def write(self, owner: object, header: Callable[[], Header], prior: Sequence[OpRecord], op: OpRecord) -> None:
        if owner is not self._owner:
            self.begin(owner, header(), prior)
        line = (json.dumps(op.to_json(), separators=(", ", ": ")) + "\n").encode()
        os.write(self._fd, line)
        self._before_last, self._size = self._size, self._size + len(line)

    def undo(self, owner: object) -> None:
        """The last operation of `owner`'s run was refused as invalid: it was never applied."""
        if owner is self._owner and self._size != self._before_last:
            os.ftruncate(self._fd, self._before_last)
            self._size = self._before_last

    def close(self) -> None:
        os.close(self._fd)


_log: Optional[WriteAheadLog] = None


def open_log(path: str | Path) -> WriteAheadLog:
    """Record every operation this process applies from now on at `path` (a child of the sandbox)."""
    global _log
    close()
    _log = WriteAheadLog(path)
    return _log


def close() -> None:
    global _log
    if _log is not None:
        _log.close()
        _log = None


def before(owner: object, header: Callable[[], Header], prior: Sequence[OpRecord], op: OpRecord) -> None:
    """`op` is about to be applied to `owner`'s run, which has applied `prior` on `header()`'s pool."""
    if _log is not None:
        _log.write(owner, header, prior, op)


T = TypeVar("T")


def recorded(
    owner: object, header: Callable[[], Header], history: List[OpRecord], op: OpRecord, apply: Callable[[], T]
) -> T:
    """`apply()` of `op` to `owner`'s run, written down first: taken back if the run refuses it as
    invalid, added to the run's `history` (what a copy of the run begins its record with) if not."""
    before(owner, header, history, op)
    try:
        result = apply()
    except InvalidOp:
        undo(owner)
        raise
    history.append(op)
    return result


def undo(owner: object) -> None:
    """The operation `before` announced for `owner` was refused as invalid (nothing changed)."""
    if _log is not None:
        _log.undo(owner)


def starting(header: Header) -> None:
    """A subject for `header`'s pool is about to be built: a death while building it is that
    run's, with no operation applied yet."""
    if _log is not None:
        _log.begin(None, header)


def last_sequence(path: str | Path) -> Optional[Tuple[Header, list[OpRecord]]]:
    """The run the record at `path` held when its process stopped (None: nothing was recorded). A
    line cut short by the death (it cannot be, as each is one write, but a full disk can) is dropped."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    if not text.strip():
        return None
    if not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    return loads(text, str(path))
