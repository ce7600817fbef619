"""Put a graph of objects back as it was, in place.

`Checkpoint(root, keep)` deep-copies what `root` reaches; `restore()` writes the copy back into
the original objects themselves (attributes, slots, list/dict/set/deque contents, tensor and
array data), so whoever holds one of them across the rollback (a watch wrapping a prefix
cache's methods, the engine's CUDA graphs holding the page table) still holds the live one.
Objects created after the checkpoint are simply no longer referenced. `keep` names objects that
are neither copied nor restored (modules, callbacks, big buffers the caller vouches for).
"""

from __future__ import annotations

import copy
import sys
from collections import deque
from functools import lru_cache
from types import MethodType
from typing import Any, Dict, Iterable, List, Tuple


class Checkpoint:
    def __init__(self, root: Any, keep: Iterable[Any] = ()) -> None:
        memo: Dict[int, Any] = {id(obj): obj for obj in keep}
        copy.deepcopy(root, memo)
        # deepcopy keeps every original it copied alive in memo[id(memo)], so the ids stay valid
        originals = memo.get(id(memo), [])
        self._pairs: List[Tuple[Any, Any]] = [(x, memo[id(x)]) for x in originals]
        self._original = {id(y): x for x, y in self._pairs}

    def _back(self, value: Any) -> Any:
        return self._original.get(id(value), value)

    def restore(self) -> None:
        back = self._back
        # looked up, not imported: the reference side runs without torch (or numpy)
        torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
        tensor, array = (torch.Tensor if torch else ()), (np.ndarray if np else ())
        for x, y in self._pairs:
            if isinstance(x, tensor):
                x.copy_(y)
            elif isinstance(x, array):
                x[...] = y
            elif isinstance(x, dict):
                items = [(back(k), back(v)) for k, v in y.items()]
                x.clear()
                x.update(items)
            elif isinstance(x, list):
                x[:] = [back(v) for v in y]
            elif isinstance(x, set):
                members = {back(v) for v in y}
                x.clear()
                x.update(members)
            elif isinstance(x, deque):
                values = [back(v) for v in y]
                x.clear()
                x.extend(values)
            elif isinstance(x, MethodType):  # its __dict__ is its function's, shared with the copy
                continue
            if hasattr(x, "__dict__"):
                state = {k: back(v) for k, v in vars(y).items()}
                vars(x).clear()
                vars(x).update(state)
            cls: type = type(x)
            for slot in _slots(cls):
                if hasattr(y, slot):
                    object.__setattr__(x, slot, back(getattr(y, slot)))
                elif hasattr(x, slot):
                    object.__delattr__(x, slot)
            # anything else (tuples, strings, numbers) is immutable: its original is intact


@lru_cache(maxsize=None)
def _slots(cls: type) -> Tuple[str, ...]:
    names = []
    for c in cls.__mro__:
        slots = c.__dict__.get("__slots__", ())
        for s in [slots] if isinstance(slots, str) else slots:
            if s in ("__dict__", "__weakref__"):
                continue
            private = s.startswith("__") and not s.endswith("__")
            names.append(f"_{c.__name__.lstrip('_')}{s}" if private else s)
    return tuple(names)
