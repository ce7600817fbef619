"""The bug zoo: realistic cache-manager bugs, each a small runtime patch of one `fast` method.

The product code carries no bug switches: `patched(name)` swaps one method of a `fast` class
for a buggy version for the duration of a `with` block (in this process only). `reference` is
never patched, so the lockstep harness sees fast diverge from the model.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Tuple

import fast


@dataclass(frozen=True)
class Bug:
    name: str
    origin: str  # where such a bug was seen (project / issue), or "ours"
    description: str
    patches: Callable[[], List[Tuple[type, str, object]]]  # (class, attribute, buggy value)


BUGS: Dict[str, Bug] = {}


def bug(name: str, origin: str, description: str):
    def register(fn: Callable[[], List[Tuple[type, str, object]]]):
        BUGS[name] = Bug(name, origin, description, fn)
        return fn
    return register


@contextmanager
def patched(name: str | None) -> Iterator[None]:
    """Apply bug `name` (None: no bug) to the fast classes inside the block."""
    if name is None:
        yield
        return
    if name not in BUGS:
        raise KeyError(f"unknown bug {name!r}; known: {', '.join(sorted(BUGS))}")
    saved = []
    try:
        for cls, attr, value in BUGS[name].patches():
            saved.append((cls, attr, cls.__dict__.get(attr, _MISSING)))
            setattr(cls, attr, value)
        yield
    finally:
        for cls, attr, old in reversed(saved):
            if old is _MISSING:
                delattr(cls, attr)
            else:
                setattr(cls, attr, old)


_MISSING = object()


@bug("no-remap-on-duplicate", "kvledger seed review (SGLang remaps req_to_token)",
     "cache_req frees duplicate prefix pages but leaves the running request's row pointing at them")
def _no_remap():
    def cache_req(self, req, *, finished):
        row = self.page_table[req.table_idx]
        locs = row[: req.cached_len]
        old = req.cache_handle
        hit, new = self.prefix_cache.insert_prefix(req.input_ids[: req.cached_len], locs)
        self.unlock(old)
        self._free(locs[old.cached_len : hit])
        if finished:
            self._free(locs[new.cached_len :])
            return
        req.cache_handle = new
        self.lock(new)
    return [(fast.CacheManager, "cache_req", cache_req)]
