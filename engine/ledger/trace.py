"""The trace format: JSON lines, one header then one operation per line.

Header: {"kvledger_trace": 2, "num_pages", "page_size", "cache_type", "table_slots",
"max_seq_len", "admission", "reserve_ratio", "seed", "producer"}. Operations are those of
`ops.py`, e.g. {"op": "submit", "uid": 3, "tokens": [5, 1, 2],
"max_tokens": 4} or {"op": "prefill", "budget": 16, "sample": [7]}; an optional "expect" records
what the producer saw (for example the batch's uids, and under optimistic admission the uids
preempted) and is checked on replay.

In memory a line is an `OpRecord` (`ops.py`): `read` parses every line at the file boundary (a bad
line is a TraceError naming its line number and field) and `write` writes each back with
`OpRecord.to_json`, byte for byte as it was read.

A subject's trace (judge mode, `kvledger fuzz --subject`) also names the subject's spec and
version ("subject", "subject_version"); its "cache_type" is the subject's kind of cache.

Versions: 2 added "admission" ("reserve" or "optimistic") and "reserve_ratio" (the fraction of the
remaining max_tokens optimistic admission reserves). A version 1 trace has neither and replays as
"reserve", the only policy there was; it is still read, and written back as version 2.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Tuple

from kvledger.engine.ledger.ops import KINDS, InvalidOp, OpRecord, TraceLine, parse_line, to_json
from kvledger.reference.admission_policy import AdmissionPolicy

VERSION = 2
READABLE = (1, 2)
OPS = tuple(KINDS)


class TraceError(ValueError):
    pass


@dataclass
class Header:
    num_pages: int
    page_size: int
    cache_type: str
    table_slots: int
    max_seq_len: int
    admission: str = "reserve"
    reserve_ratio: float = 0.5
    seed: int | None = None
    producer: str = "unknown"
    subject: str | None = None  # a trace of a subject under judge mode: its spec and version
    subject_version: str | None = None
    kvledger_trace: int = field(default=VERSION)
    spec_tokens: int = 0  # lockstep: drafts each decode verifies per request (written only when > 0)

    def validate(self) -> None:
        if not isinstance(self.spec_tokens, int) or self.spec_tokens < 0:
            raise TraceError(f"header: spec_tokens must be a non-negative integer, got {self.spec_tokens!r}")
        for name in ("num_pages", "page_size", "table_slots", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise TraceError(f"header: {name} must be a positive integer, got {value!r}")
        if self.cache_type not in ("naive", "radix"):
            raise TraceError(f"header: cache_type must be 'naive' or 'radix', got {self.cache_type!r}")
        if self.kvledger_trace not in READABLE:
            raise TraceError(
                f"header: trace version {self.kvledger_trace!r} is not supported "
                f"(this kvledger reads {', '.join(map(str, READABLE))})"
            )
        try:
            _ = self.policy  # a bad admission field raises here
        except ValueError as e:
            raise TraceError(f"header: {e}") from None

    @property
    def policy(self) -> AdmissionPolicy:
        return AdmissionPolicy(self.admission, self.reserve_ratio)

    def cache_scheduler_args(self) -> Dict[str, Any]:
        return {
            "num_pages": self.num_pages,
            "page_size": self.page_size,
            "cache_type": self.cache_type,
            "table_slots": self.table_slots,
            "max_seq_len": self.max_seq_len,
            "admission": self.policy,
        }


def dumps(header: Header, ops: Iterable[TraceLine]) -> str:
    head = {"kvledger_trace": VERSION, **{k: v for k, v in asdict(header).items() if k != "kvledger_trace"}}
    if not header.spec_tokens:  # a field added after traces existed: written only when set
        del head["spec_tokens"]
    return "\n".join(json.dumps(x, separators=(", ", ": ")) for x in [head, *map(_json, ops)]) + "\n"


def _json(line: TraceLine) -> Dict[str, Any]:
    """A line as the file writes it (a dict, from a caller not yet typed, as it is)."""
    if isinstance(line, OpRecord):
        return line.to_json()
    if isinstance(line, dict):
        return line
    return to_json(line)


def write(path: str | Path, header: Header, ops: Iterable[TraceLine]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(dumps(header, ops))


def loads(text: str, source: str = "<trace>") -> Tuple[Header, List[OpRecord]]:
    lines = [(i + 1, line) for i, line in enumerate(text.splitlines()) if line.strip()]
    if not lines:
        raise TraceError(f"{source}: empty trace (no header line)")
    records = []
    for lineno, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{source}:{lineno}: not valid JSON: {e.msg}") from None
        if not isinstance(record, dict):
            raise TraceError(f"{source}:{lineno}: each line must be a JSON object")
        records.append(record)
    head = records[0]
    if "kvledger_trace" not in head:
        raise TraceError(f"{source}:1: the first line must be the header with 'kvledger_trace'")
    if head.get("kvledger_trace") == 1 and ({"admission", "reserve_ratio"} & set(head)):
        raise TraceError(f"{source}:1: a version 1 header has no admission fields (they came with version 2)")
    try:
        header = Header(**head)
    except TypeError as e:
        raise TraceError(f"{source}:1: bad header: {e}") from None
    header.validate()
    parsed = []
    for (lineno, _), op in zip(lines[1:], records[1:]):
        if op.get("op") not in OPS:
            raise TraceError(f"{source}:{lineno}: unknown op {op.get('op')!r} (expected one of {', '.join(OPS)})")
        try:
            parsed.append(parse_line(op))
        except InvalidOp as e:
            raise TraceError(f"{source}:{lineno}: {e}") from None
    return header, parsed


def read(path: str | Path) -> Tuple[Header, List[OpRecord]]:
    return loads(Path(path).read_text(), str(path))
