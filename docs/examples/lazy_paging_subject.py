"""A worked subject for the four capabilities of a paging manager that is not shaped like
kvledger's built-ins: a small, real block manager written for the docs, and its declaration.

The manager keeps a block hash map (the key of a full page is its whole token prefix) that holds
a reference of its own on every page it maps (`cache_holds_reference`). Admission evicts cached
pages nobody holds until the first chunk fits, *then* decides, and keeps that eviction when it
refuses (`evicts_before_admit`). A preempted request keeps its pages (lazily freed): admitted
again, it resumes on them; dropped, it releases them; and an allocation that finds the free list
empty takes them back, oldest victim first (`preempt_keeps_pages`). When an allocation fails,
the request that asked is the one preempted, not the newest (`chooses_victim`).

Run it: `PYTHONPATH=docs/examples kvledger check --subject lazy_paging_subject:build`.
The other factories plant one bug each, for the tests (`tests/properties/test_misfit_example.py`).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import Dict, Iterable, List, Sequence, Set, Tuple

from kvledger.checker import CachedEntry, Capabilities, SubjectConfig, View


class LazyPagingCache:
    name, version = "lazy-paging-example", "1"

    def __init__(self, config: SubjectConfig, bug: str | None = None) -> None:
        ps = self.ps = config.page_size
        self.capabilities = Capabilities(
            page_size=ps,
            pages=tuple(range(config.num_pages)),
            worst_case_admission=False,
            preempts=True,
            explicit_evict=False,
            cached_pages_in_free_pool=False,
            evicts_before_admit=True,
            preempt_keeps_pages=True,
            chooses_victim=True,
            cache_holds_reference=True,
        )
        self.bug = bug
        self.max_rows = config.max_running_req
        self.free = deque(range(config.num_pages))
        self.ref = [0] * config.num_pages
        self.blocks: Dict[Tuple[int, ...], int] = {}  # the block hash map: prefix key -> page
        self.key_of: Dict[int, Tuple[int, ...]] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached pages, least recently used first
        self.tokens: Dict[int, List[int]] = {}  # every known request: prompt + sampled tokens
        self.pages: Dict[int, List[int]] = {}  # running requests' pages
        self.kept: Dict[int, List[int]] = {}  # preempted requests' pages, oldest victim first
        self.written: Dict[int, int] = {}  # positions whose KV a request (running or kept) holds

    # -- the manager's own bookkeeping ---------------------------------------------------------
    def cache_key(self, tokens: Sequence[int]) -> Tuple[int, ...]:
        return tuple(tokens[: len(tokens) // self.ps * self.ps])

    def _pages_for(self, positions: int) -> int:
        return -(-positions // self.ps)

    def _match(self, tokens: Sequence[int]) -> List[int]:
        """The cached pages of the longest prefix of full pages, leaving the last token to compute."""
        hit: List[int] = []
        for i in range((len(tokens) - 1) // self.ps):
            page = self.blocks.get(tuple(tokens[: (i + 1) * self.ps]))
            if page is None:
                break
            hit.append(page)
        return hit

    def _evictable(self, protect: Set[int]) -> List[int]:
        """Cached pages only the map references, least recently used first."""
        if self.bug == "evicts-locked":  # forgets that a running request may hold a cached page
            return [p for p in self.lru if p not in protect]
        return [p for p in self.lru if self.ref[p] == 1 and p not in protect]

    def _evict(self, page: int) -> None:
        del self.blocks[self.key_of.pop(page)]
        del self.lru[page]
        self._unref([page])
        if self.bug == "drops-cache-ref-twice":
            self.ref[page] -= 1

    def _unref(self, pages: Iterable[int]) -> None:
        for page in pages:
            self.ref[page] -= 1
            if self.ref[page] == 0:
                self.free.append(page)

    def _spare(self, protect: Set[int], keep: int | None = None) -> int:
        """Pages an allocation could get: free ones, and those only the map or other preempted
        requests (not `keep`) reference."""
        kept = Counter(p for uid, row in self.kept.items() if uid != keep for p in row)
        loose = [p for p, n in enumerate(self.ref) if n and p not in protect and n == kept[p] + (p in self.key_of)]
        return len(self.free) + len(loose)

    def _take(self) -> int:
        while not self.free:
            evictable = self._evictable(set())
            if evictable:
                self._evict(evictable[0])
            else:  # the lazy free: the oldest victim's pages go back now
                uid = next(iter(self.kept))
                self._unref(self.kept.pop(uid))
                self.written.pop(uid)
        page = self.free.popleft()
        self.ref[page] = 1
        return page

    # -- the subject protocol ------------------------------------------------------------------
    def submit(self, uid: int, prompt: Sequence[int], max_tokens: int) -> None:
        self.tokens[uid] = list(prompt)

    def admit(self, uid: int, budget: int) -> int | None:
        tokens = self.tokens[uid]
        if len(self.pages) >= self.max_rows:
            return None
        if uid in self.kept:  # resumed: the KV it kept is its hit
            pages, hit = self.kept[uid], self.written[uid]
        else:
            pages = self._match(tokens)
            hit = len(pages) * self.ps
        need = self._pages_for(min(hit + budget, len(tokens))) - len(pages)
        for page in self._evictable(set(pages))[: max(need - len(self.free), 0)]:
            self._evict(page)  # before deciding, and kept if it refuses
        if need > self._spare(set(pages), keep=uid):
            return None
        if uid in self.kept:
            del self.kept[uid]
        else:
            for page in pages:
                self.ref[page] += 1
                self.lru.move_to_end(page)
        self.pages[uid], self.written[uid] = list(pages), hit
        return hit

    def allocate(self, uid: int, start: int, end: int) -> bool:
        pages = self.pages[uid]
        if self._pages_for(end) - len(pages) > self._spare(set(pages)):
            return False
        while len(pages) * self.ps < end:
            pages.append(self._take())
        return True

    def victim(self, uid: int) -> int:
        if self.bug == "names-a-waiting-victim":  # the newest request it knows, running or not
            return next(reversed(self.tokens))
        return uid  # the request whose allocation failed gives way

    def computed(self, uid: int, start: int, end: int, token: int | None) -> None:
        tokens, pages = self.tokens[uid], self.pages[uid]
        for i in range(start // self.ps, end // self.ps):  # the pages this pass filled
            key, page = tuple(tokens[: (i + 1) * self.ps]), pages[i]
            if key not in self.blocks and page not in self.key_of:
                self.blocks[key], self.key_of[page] = page, key
                self.ref[page] += 1  # the map's own reference
                self.lru[page] = None
        self.written[uid] = end
        if token is not None:
            tokens.append(token)

    def preempt(self, uid: int) -> None:
        self.kept[uid] = self.pages.pop(uid)  # freed lazily: see _take, admit and abort

    def finish(self, uid: int) -> None:
        self._unref(reversed(self.pages.pop(uid)))
        del self.tokens[uid], self.written[uid]

    def abort(self, uid: int) -> None:
        if uid in self.pages:
            self.finish(uid)
            return
        if uid in self.kept:
            kept = self.kept.pop(uid)
            if self.bug != "abort-leaks-kept":
                self._unref(reversed(kept))
            del self.written[uid]
        del self.tokens[uid]

    def evict(self, tokens: int) -> int:
        raise NotImplementedError("no explicit eviction: admission and allocation evict")

    def view(self) -> View:
        def locations(pages: List[int]) -> List[int]:
            return [p * self.ps + offset for p in pages for offset in range(self.ps)]

        return View(
            free=list(self.free),
            requests={uid: locations(pages) for uid, pages in self.pages.items()},
            cached=[
                CachedEntry(tuple(locations([p])), start=None, key=key, name=f"block {p}")
                for p, key in self.key_of.items()
            ],
            page_refs=dict(enumerate(self.ref)),
            counters={"free_pages": len(self.free)},
            preempted={uid: locations(pages) for uid, pages in self.kept.items()},
        )


def build(config: SubjectConfig) -> LazyPagingCache:
    return LazyPagingCache(config)


def evicts_locked(config: SubjectConfig) -> LazyPagingCache:
    return LazyPagingCache(config, bug="evicts-locked")


def abort_leaks_kept(config: SubjectConfig) -> LazyPagingCache:
    return LazyPagingCache(config, bug="abort-leaks-kept")


def names_a_waiting_victim(config: SubjectConfig) -> LazyPagingCache:
    return LazyPagingCache(config, bug="names-a-waiting-victim")


def drops_cache_ref_twice(config: SubjectConfig) -> LazyPagingCache:
    return LazyPagingCache(config, bug="drops-cache-ref-twice")
