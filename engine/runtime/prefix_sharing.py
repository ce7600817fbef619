"""Whether two running requests can hold the same KV pages, decided on the host per decode step.

Pages are shared only through the radix cache, which matches by token content from the root, so
two requests that share a page share every token before it and their first tokens are equal. One
of them found the page in the cache when it was admitted (a hit). Sharing of at least
`MIN_SHARED` tokens is therefore possible only while some live request that was admitted with a
hit of that length has the same first `MIN_SHARED` tokens as another live request.

A request that hits only its own earlier conversation (a multi-turn chat) leaves this False, and
decode replays the graphs without cascade attention. False is a guarantee; True is only a
possibility, and the grouping on the device then finds what is shared.
"""

from __future__ import annotations

from collections import Counter
from typing import Dict, Sequence, Set, Tuple

from kvledger.engine.attention.shared_prefix import MIN_SHARED


class PrefixSharing:
    """Counts per start (first `min_shared` tokens) of the live requests and of those among them
    admitted with a hit; `possible` reads one set, so a decode step pays nothing per request."""

    def __init__(self, min_shared: int = MIN_SHARED) -> None:
        self.min_shared = min_shared
        self._key: Dict[int, Tuple[int, ...]] = {}  # live uid -> its first min_shared tokens
        self._count: Counter = Counter()  # key -> live requests with it
        self._hits: Set[int] = set()  # live uids admitted with a hit of at least min_shared tokens
        self._hit_count: Counter = Counter()  # key -> live requests with it and such a hit
        self._sharing: Set[Tuple[int, ...]] = set()  # keys with a hit and at least two live requests

    def admitted(self, uid: int, tokens: Sequence[int], hit: int) -> None:
        """A request entered the running set (again, after a preemption) with `hit` cached tokens."""
        if uid not in self._key:
            self._key[uid] = tuple(int(t) for t in tokens[: self.min_shared])
            self._count[self._key[uid]] += 1
        if hit >= self.min_shared and uid not in self._hits:
            self._hits.add(uid)
            self._hit_count[self._key[uid]] += 1
        self._update(self._key[uid])

    def forget(self, uid: int) -> None:
        key = self._key.pop(uid, None)
        if key is None:
            return
        self._count[key] -= 1
        if uid in self._hits:
            self._hits.discard(uid)
            self._hit_count[key] -= 1
        self._update(key)
        for counts in (self._count, self._hit_count):
            if not counts[key]:
                del counts[key]

    def _update(self, key: Tuple[int, ...]) -> None:
        if self._hit_count[key] >= 1 and self._count[key] >= 2:
            self._sharing.add(key)
        else:
            self._sharing.discard(key)

    @property
    def possible(self) -> bool:
        return bool(self._sharing)
