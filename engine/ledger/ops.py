"""The cache operations, typed: one frozen dataclass per operation of the cache-side scheduler.

This module is the one list of operations; the docs link here. A trace line is an operation as
JSON (`{"op": "prefill", "budget": 64, ...}`, plus an optional `expect` the replay checks);
`parse` turns one into its dataclass, checking every field, and `to_json` turns it back. The
CacheScheduler dispatches on the dataclass, so a misspelt or mistyped field is an InvalidOp naming
it, never a TypeError from deep inside. The engine builds typed operations (`OpRecord`: the
operation and what the engine saw it do) and hands them to its observers; only the trace recorder
turns them into JSON.

  Submit(uid, tokens, max_tokens)  queue a request for admission
  Prefill(budget, sample, stop)    admit from the queue head within a token budget, allocate,
                                   "run" the batch, cache_req(finished=False) or free at finish
  Decode(sample, stop)             one decode step for every running request
  Finish(uid)                      a running request stops early (EOS)
  Abort(uid)                       drop a request wherever it is, freeing what it holds
  Evict(tokens)                    evict from the prefix cache directly, freeing the pages
  Probe(tokens)                    match, lock, read available_size, unlock

`sample` gives the sampled tokens in batch order (cycled), so a trace replays identically; `stop`
names requests whose sampled token ends them (EOS or a stop token); one that names a request
sampling nothing in the step is refused (InvalidOp), and like every refusal it changes nothing.
Under a preempting admission policy a prefill or decode whose pages do not fit first preempts the
newest live requests (see `cache_scheduler.py`).
"""

from __future__ import annotations

import numbers
from dataclasses import MISSING, dataclass, fields
from typing import Any, Dict, Iterable, Optional, Tuple, Union


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


@dataclass(frozen=True)
class Decode:
    sample: Tuple[int, ...] = ()
    stop: Tuple[int, ...] = ()


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
class Expect:
    """What the producer saw an operation do, checked on replay: the batch's uids in order and,
    under a preempting admission policy, the uids preempted to make room (None: not recorded)."""

    batch: Tuple[int, ...]
    preempted: Optional[Tuple[int, ...]] = None

    def as_dict(self) -> Dict[str, Any]:
        seen: Dict[str, Any] = {"batch": list(self.batch)}
        if self.preempted is not None:
            seen["preempted"] = list(self.preempted)
        return seen


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


@dataclass(frozen=True)
class OpRecord:
    """One operation as the engine performed it: what observers (recorder, shadow) are told."""

    op: CacheOp
    expect: Optional[Expect] = None

    @property
    def name(self) -> str:
        return NAMES[type(self.op)]

    def to_json(self) -> Dict[str, Any]:
        line = to_json(self.op)
        if self.expect is not None:
            line["expect"] = self.expect.as_dict()
        return line


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


def to_json(op: CacheOp) -> Dict[str, Any]:
    """The operation as a trace line (without `expect`)."""
    return {"op": NAMES[type(op)], **{f.name: _plain(getattr(op, f.name)) for f in fields(op)}}


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
