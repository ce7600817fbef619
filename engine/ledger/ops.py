"""The cache operations, typed: one frozen dataclass per operation of the cache-side scheduler.

This module is the one list of operations; the docs link here. A trace line is an operation as
JSON (`{"op": "prefill", "budget": 64, ...}`, plus an optional `expect` the replay checks);
`parse` turns one into its dataclass, checking every field, and `to_json` turns it back;
`parse_line` and `OpRecord.to_json` do the same for a whole line, `expect` included. `OpRecord` is
the typed trace line: what `trace.read` returns, what the drivers apply and record, what the
minimizer shrinks (`dataclasses.replace`) and the engine hands to its observers. Both drivers
(`CacheScheduler`, the subject driver) go through one `dispatch` over the dataclasses, so a misspelt
or mistyped field is an InvalidOp naming it, never a TypeError from deep inside.

  Submit(uid, tokens, max_tokens)  queue a request for admission
  Prefill(budget, sample, stop)    admit from the queue head within a token budget, allocate,
                                   "run" the batch, cache_req(finished=False) or free at finish
  Decode(sample, stop)             one decode step for every running request
  Finish(uid)                      a running request stops early (EOS)
  Abort(uid)                       drop a request wherever it is, freeing what it holds
  Evict(tokens)                    evict from the prefix cache directly, freeing the pages
  Probe(tokens)                    match, lock, read available_size, unlock

`accept` (a subject that speculates only) gives, per request verifying drafts in batch order
(cycled), how many of its drafts the model accepts; empty: none. A line leaves it out when empty.
For a subject that schedules itself (`properties/scheduling_subject.py`) a prefill and a decode are
each one step of its own scheduler: a prefill's budget caps the step's tokens, a decode runs with
the subject's configured budget.

`sample` gives the sampled tokens in batch order (cycled), so a trace replays identically; `stop`
names requests whose sampled token ends them (EOS or a stop token); one that names a request
sampling nothing in the step is refused (InvalidOp), and like every refusal it changes nothing.
Under a preempting admission policy a prefill or decode whose pages do not fit first preempts the
newest live requests (see `cache_scheduler.py`).
"""

from __future__ import annotations

import numbers
from dataclasses import MISSING, dataclass, fields
from typing import Any, Dict, FrozenSet, Iterable, Mapping, Optional, Protocol, Sequence, Tuple, Union


class InvalidOp(ValueError):
    """An operation that makes no sense at its point (a bad trace, not a bug in the manager)."""


@dataclass(frozen=True)
class Submit:
    uid: int
    tokens: Tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Prefill:
    budget: int
    sample: Tuple[int, ...] = ()
    stop: Tuple[int, ...] = ()
    accept: Tuple[int, ...] = ()


@dataclass(frozen=True)
class Decode:
    sample: Tuple[int, ...] = ()
    stop: Tuple[int, ...] = ()
    accept: Tuple[int, ...] = ()


@dataclass(frozen=True)
class Finish:
    uid: int


@dataclass(frozen=True)
class Abort:
    uid: int


@dataclass(frozen=True)
class Evict:
    tokens: int


@dataclass(frozen=True)
class Probe:
    tokens: Tuple[int, ...]


CacheOp = Union[Submit, Prefill, Decode, Finish, Abort, Evict, Probe]
KINDS: Dict[str, Any] = {
    "submit": Submit,
    "prefill": Prefill,
    "decode": Decode,
    "finish": Finish,
    "abort": Abort,
    "evict": Evict,
    "probe": Probe,
}
NAMES = {cls: name for name, cls in KINDS.items()}
TRACE_ONLY = ("op", "expect")  # fields of a trace line that are not the operation's


@dataclass(frozen=True)
class OpResult:
    """What an operation did, as a driver (the cache scheduler, the subject driver) returns it.
    A field an operation does not produce is None.

    batch       prefill, decode: the uids that ran, in batch order
    refused     prefill: the uid turned away at admission (the walk of the queue ends there)
    preempted   prefill, decode: the uids preempted to make room, in order; None where the
                admission policy never preempts
    where       abort: "waiting" or "running" (the cache scheduler)
    evicted     evict: the KV locations freed (the cache scheduler)
    evicted_tokens  evict: the tokens a subject says it evicted
    cached_len, indices, locked_available  probe: the match's length and locations, and
                available_size while it is locked
    """

    batch: Optional[Tuple[int, ...]] = None
    refused: Optional[int] = None
    preempted: Optional[Tuple[int, ...]] = None
    where: Optional[str] = None
    evicted: Optional[Tuple[int, ...]] = None
    evicted_tokens: Optional[int] = None
    cached_len: Optional[int] = None
    indices: Optional[Tuple[int, ...]] = None
    locked_available: Optional[int] = None

    def seen(self, keys: Iterable[str]) -> Dict[str, Any]:
        """The fields a trace's `expect` names, as the trace line writes them (lists, None).
        Older traces name the refused uid "rejected" (the file format keeps that name)."""
        names = {f.name for f in fields(self)}
        out = {}
        for key in keys:
            name = _EXPECT_ALIASES.get(key, key)
            out[key] = _plain(getattr(self, name)) if name in names else None
        return out

    def matches(self, expect: Dict[str, Any]) -> bool:
        """Whether this result is what a trace line's `expect` recorded."""
        return self.seen(expect) == expect


_EXPECT_ALIASES = {"rejected": "refused"}
_RESULT_FIELDS = {f.name: str(f.type) for f in fields(OpResult)}


@dataclass(frozen=True)
class Expect:
    """What the producer saw an operation do, checked on replay: some fields of its `OpResult`,
    under the names the trace line writes them, in its order (older traces name the refused uid
    "rejected"; a name whose value is null is written, and checked, as null)."""

    seen: OpResult
    names: Tuple[str, ...]

    @classmethod
    def of_batch(cls, batch: Sequence[int], preempted: Optional[Sequence[int]] = None) -> Expect:
        """The engine's record of a prefill or decode: its batch and, under a preempting
        admission policy, the uids it preempted."""
        seen = OpResult(batch=tuple(batch), preempted=None if preempted is None else tuple(preempted))
        return cls(seen, ("batch",) if preempted is None else ("batch", "preempted"))

    @classmethod
    def parse(cls, recorded: Mapping[str, Any]) -> Expect:
        """A trace line's `expect` object -> an Expect; InvalidOp naming a bad field."""
        values: Dict[str, Any] = {}
        for name, value in recorded.items():
            field_name = _EXPECT_ALIASES.get(name, name)
            kind = _RESULT_FIELDS.get(field_name)
            if kind is None:
                raise InvalidOp(f"expect: unknown field {name!r}; it takes {sorted(_RESULT_FIELDS)}")
            if value is None:
                continue
            if "str" in kind:
                if not isinstance(value, str):
                    raise InvalidOp(f"expect: {name} must be a string, got {value!r:.80}")
                values[field_name] = value
            else:
                values[field_name] = _checked("expect", name, value, many="Tuple" in kind)
        return cls(OpResult(**values), tuple(recorded))

    def as_dict(self) -> Dict[str, Any]:
        return self.seen.seen(self.names)

    def matches(self, result: OpResult) -> bool:
        """Whether `result` is what was recorded."""
        return result.seen(self.names) == self.as_dict()


# fields added after traces existed: written only when set, so every older trace reads and writes back the same
_EMPTY_OPTIONAL = frozenset({"accept"})


@dataclass(frozen=True)
class OpRecord:
    """One trace line, typed: the operation and what its producer saw it do (checked on replay).
    `absent` names the fields the line leaves out at their defaults (a fuzzer writes `stop` only
    when it stops something), so that a line read and written back is the same bytes."""

    op: CacheOp
    expect: Optional[Expect] = None
    absent: FrozenSet[str] = frozenset()

    def __post_init__(self) -> None:
        # an optional field added after traces existed is absent whenever it is empty, however
        # the record was made, so records read back compare equal to those written
        empty = _EMPTY_OPTIONAL.intersection(f.name for f in fields(self.op) if getattr(self.op, f.name) == ())
        if not empty <= self.absent:
            object.__setattr__(self, "absent", self.absent | empty)

    @property
    def name(self) -> str:
        return NAMES[type(self.op)]

    def to_json(self) -> Dict[str, Any]:
        line = to_json(self.op, self.absent)
        if self.expect is not None:
            line["expect"] = self.expect.as_dict()
        return line


def written(op: CacheOp, expect: Optional[Expect] = None) -> OpRecord:
    """`op` as the checker's generators (fuzzers, explorer) write it: a `stop` that stops nothing is
    left out (the engine's recorder writes every field: `OpRecord(op)`)."""
    stops = isinstance(op, (Prefill, Decode)) and not op.stop
    return OpRecord(op, expect, _NO_STOP if stops else frozenset())


_NO_STOP = frozenset({"stop"})
TraceLine = Union[OpRecord, CacheOp, Dict[str, Any]]  # what a driver's apply accepts (dicts: until callers are typed)


def as_record(line: TraceLine) -> OpRecord:
    """A trace line in any of its forms as an OpRecord (a dict is parsed: InvalidOp names what is wrong)."""
    if isinstance(line, OpRecord):
        return line
    if isinstance(line, dict):
        return parse_line(line)
    return OpRecord(line)


def parse(line: Dict[str, Any]) -> CacheOp:
    """A trace line -> its operation; InvalidOp naming what is wrong."""
    kind = line.get("op")
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None or not isinstance(kind, str):
        raise InvalidOp(f"unknown operation {kind!r}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(line) - names - set(TRACE_ONLY))
    if unknown:
        raise InvalidOp(f"{kind}: unknown field(s) {unknown}; it takes {sorted(names)}")
    values = {}
    for f in fields(cls):
        if f.name not in line:
            if f.default is MISSING:
                raise InvalidOp(f"{kind}: missing field {f.name!r}")
            continue
        values[f.name] = _checked(kind, f.name, line[f.name], many=str(f.type).startswith("Tuple"))
    op: CacheOp = cls(**values)
    return op


def parse_line(line: Dict[str, Any]) -> OpRecord:
    """A whole trace line -> its OpRecord (the operation, its `expect`, the fields it leaves out)."""
    op = parse(line)
    recorded = line.get("expect")
    if recorded is not None and not isinstance(recorded, dict):
        raise InvalidOp(f"expect must be an object, got {recorded!r:.80}")
    expect = Expect.parse(recorded) if recorded is not None else None
    absent = frozenset(f.name for f in fields(op) if f.name not in line)
    return OpRecord(op, expect, absent)


def to_json(op: CacheOp, absent: Iterable[str] = ()) -> Dict[str, Any]:
    """The operation as a trace line (without `expect`), leaving out the fields named `absent`."""
    skip = frozenset(absent) | _EMPTY_OPTIONAL.intersection(f.name for f in fields(op) if getattr(op, f.name) == ())
    return {"op": NAMES[type(op)], **{f.name: _plain(getattr(op, f.name)) for f in fields(op) if f.name not in skip}}


class OpHandler(Protocol):
    """What `dispatch` drives: a method per operation (the cache scheduler, the subject driver)."""

    def submit(self, uid: int, tokens: Sequence[int], max_tokens: int) -> OpResult: ...

    def prefill(self, budget: int, sample: Sequence[int] = (), stop: Sequence[int] = ()) -> OpResult: ...

    def decode(self, sample: Sequence[int] = (), stop: Sequence[int] = ()) -> OpResult: ...

    def finish(self, uid: int) -> OpResult: ...

    def abort(self, uid: int) -> OpResult: ...

    def evict(self, tokens: int) -> OpResult: ...

    def probe(self, tokens: Sequence[int]) -> OpResult: ...


def dispatch(op: CacheOp, handler: OpHandler) -> OpResult:
    """The one dispatch over the operations: `op` applied through `handler`'s method for it."""
    match op:
        case Submit(uid, tokens, max_tokens):
            return handler.submit(uid, tokens, max_tokens)
        case Prefill(budget, sample, stop, accept):
            if accept:
                result: OpResult = _speculating(handler, "prefill").prefill(budget, sample, stop, accept=accept)
                return result
            return handler.prefill(budget, sample, stop)
        case Decode(sample, stop, accept):
            if accept:
                result = _speculating(handler, "decode").decode(sample, stop, accept=accept)
                return result
            return handler.decode(sample, stop)
        case Finish(uid):
            return handler.finish(uid)
        case Abort(uid):
            return handler.abort(uid)
        case Evict(tokens):
            return handler.evict(tokens)
        case Probe(tokens):
            return handler.probe(tokens)
    raise InvalidOp(f"not a cache operation: {op!r:.80}")


def _speculating(handler: OpHandler, kind: str) -> Any:
    if not getattr(handler, "speculates", False):
        raise InvalidOp(f"{kind}: accept is for a subject that speculates (capability spec_tokens)")
    return handler


def _checked(kind: str, name: str, value: Any, many: bool) -> Any:
    if many:
        if not isinstance(value, (list, tuple)) or not all(_is_int(v) for v in value):
            raise InvalidOp(f"{kind}: {name} must be a list of integers, got {value!r:.80}")
        return tuple(int(v) for v in value)
    if not _is_int(value):
        raise InvalidOp(f"{kind}: {name} must be an integer, got {value!r:.80}")
    return int(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
