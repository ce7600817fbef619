"""The running requests of a DecodeManager, in admission order.

The seed keeps them in a set of `Req`, so code written against it iterates requests; a set has
no order, and the decode batch must be in admission order to replay identically. This is that
set with an order: iterating yields requests, `in` asks about a request, and `get(uid)` finds one
by uid (what the scheduler's `finish` and `abort` need).
"""

from __future__ import annotations

from typing import Dict, Generic, Iterator, List, Optional, Protocol, TypeVar


class HasUid(Protocol):
    @property
    def uid(self) -> int: ...


R = TypeVar("R", bound=HasUid)


class RunningReqs(Generic[R]):
    def __init__(self) -> None:
        self._by_uid: Dict[int, R] = {}

    def add(self, req: R) -> None:
        """Add `req` at the end, unless it is already running (it keeps its place)."""
        self._by_uid.setdefault(req.uid, req)

    def discard(self, req: R) -> None:
        self._by_uid.pop(req.uid, None)

    def get(self, uid: int) -> Optional[R]:
        return self._by_uid.get(uid)

    def uids(self) -> List[int]:
        return list(self._by_uid)

    def __iter__(self) -> Iterator[R]:
        return iter(list(self._by_uid.values()))  # a copy: callers may discard while iterating

    def __len__(self) -> int:
        return len(self._by_uid)

    def __contains__(self, req: object) -> bool:
        return self._by_uid.get(getattr(req, "uid", None)) is req
