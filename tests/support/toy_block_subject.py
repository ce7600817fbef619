"""A small hash-chained block cache, written for the judge's and driver's tests: nano-vllm's
shape (blocks for the whole prompt at admission, full blocks published after each forward, the
cached blocks nobody holds left in the free queue, reused oldest first). `bug` plants one mistake
at a time, so a test shows the judge names it. Also a user's `module:factory` subject for the CLI."""

from __future__ import annotations

from collections import deque
from typing import Dict, List, Sequence

from kvledger.properties.subject import CachedEntry, Capabilities, SubjectConfig, View


class ToyBlockCache:
    name = "toy"
    version = "1"

    def __init__(self, config: SubjectConfig, bug: str | None = None) -> None:
        self.bs, n = config.page_size, config.num_pages
        self.capabilities = Capabilities(
            page_size=self.bs,
            pages=tuple(range(n)),
            worst_case_admission=False,
            preempts=True,
            explicit_evict=False,
            cached_pages_in_free_pool=True,
        )
        self.bug = bug
        self.ref = [0] * n
        self.key: List[tuple | None] = [None] * n
        self.index: Dict[tuple, int] = {}
        self.free = deque(range(n))
        self.tables: Dict[int, List[int]] = {}
        self.tokens: Dict[int, List[int]] = {}

    def cache_key(self, tokens: Sequence[int]) -> tuple:
        return tuple(tokens[: len(tokens) // self.bs * self.bs])

    def submit(self, uid: int, prompt: Sequence[int], max_tokens: int) -> None:
        self.tokens[uid] = list(prompt)

    def _take(self) -> int:
        block = self.free.popleft()
        if self.key[block] is not None and self.index.get(self.key[block]) == block:
            del self.index[self.key[block]]
        self.key[block], self.ref[block] = None, 1
        return block

    def admit(self, uid: int, budget: int) -> int | None:
        tokens, hit = self.tokens[uid], []
        blocks = (len(tokens) - 1) // self.bs + (1 if self.bug == "hit-covers-last-token" else 0)
        for i in range(blocks):
            block = self.index.get(tuple(tokens[: (i + 1) * self.bs]))
            if block is None:
                break
            hit.append(block)
        need = -(-len(tokens) // self.bs) - sum(1 for b in hit if self.ref[b])
        if need > len(self.free):
            return None
        table = []
        for block in hit:
            if self.ref[block] == 0:
                self.free.remove(block)
            self.ref[block] += 1 if self.bug != "hit-skips-ref" else 0
            table.append(block)
        while len(table) * self.bs < len(tokens):
            table.append(self._take())
        self.tables[uid] = table
        return len(hit) * self.bs

    def allocate(self, uid: int, start: int, end: int) -> bool:
        table = self.tables[uid]
        while len(table) * self.bs < end:
            if not self.free:
                return False
            table.append(self._take())
        return True

    def computed(self, uid: int, start: int, end: int, token: int | None) -> None:
        tokens = self.tokens[uid]
        for i in range(start // self.bs, end // self.bs):
            block, key = self.tables[uid][i], tuple(tokens[: (i + 1) * self.bs])
            if self.bug == "key-forgets-parent":
                key = tuple(tokens[i * self.bs : (i + 1) * self.bs])
            self.key[block], self.index[key] = key, block
        if token is not None:
            tokens.append(token)

    def _release(self, uid: int) -> None:
        for block in reversed(self.tables.pop(uid, [])):
            self.ref[block] -= 1
            if self.ref[block] == 0 and self.bug != "leak-on-release":
                self.free.append(block)

    def finish(self, uid: int) -> None:
        self._release(uid)
        del self.tokens[uid]

    def abort(self, uid: int) -> None:
        if self.bug == "abort-raises":
            raise KeyError(uid)
        self._release(uid)
        self.tokens.pop(uid, None)

    def preempt(self, uid: int) -> None:
        self._release(uid)

    def evict(self, tokens: int) -> int:
        return 0

    def view(self) -> View:
        requests = {
            uid: [b * self.bs + p % self.bs for p, b in ((p, table[p // self.bs]) for p in range(len(table) * self.bs))]
            for uid, table in self.tables.items()
        }
        cached = [
            CachedEntry(tuple(range(b * self.bs, (b + 1) * self.bs)), start=None, key=k, name=f"block {b}")
            for b, k in enumerate(self.key)
            if k is not None
        ]
        return View(
            free=list(self.free),
            requests=requests,
            cached=cached,
            page_refs=dict(enumerate(self.ref)),
            counters={"free_pages": len(self.free)},
        )


def factory(config: SubjectConfig) -> ToyBlockCache:
    return ToyBlockCache(config)


def leaky(config: SubjectConfig) -> ToyBlockCache:
    return ToyBlockCache(config, bug="leak-on-release")
