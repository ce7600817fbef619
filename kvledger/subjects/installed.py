"""A subject that is an installed package (vLLM, SGLang): probing it without importing it, and
importing it once per process, with one line naming what is missing when that fails."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import threading
from typing import Callable, Generic, Optional, Sequence, Tuple, TypeVar

from kvledger.properties.subject import SubjectUnavailable

T = TypeVar("T")


class InstalledPackage(Generic[T]):
    def __init__(self, dist: str, pinned: str, modules: Sequence[str], install: str, load: Callable[[], T]) -> None:
        self.dist, self.pinned, self.modules, self.install = dist, pinned, tuple(modules), install
        self._load, self._lock = load, threading.Lock()
        self._loaded: Optional[T] = None

    def probe(self) -> Tuple[bool, str, str]:
        """(installed, version, detail), from package metadata and module specs: nothing imported."""
        try:
            version = importlib.metadata.version(self.dist)
        except importlib.metadata.PackageNotFoundError:
            return False, "", f"{self.dist} is not installed: {self.install}"
        missing = [m for m in self.modules if importlib.util.find_spec(m) is None]
        if missing:
            return False, version, f"{self.dist} {version} lacks modules {', '.join(missing)}: {self.install}"
        detail = f"{self.dist} {version}"
        if version != self.pinned:
            detail += f" (the zoo is written against {self.pinned}; its edits may not apply)"
        return True, version, detail

    def load(self) -> T:
        """The imported package's pieces, imported on first use (seconds: they pull in much)."""
        with self._lock:
            if self._loaded is None:
                try:
                    self._loaded = self._load()
                except ImportError as e:
                    raise SubjectUnavailable(f"{self.dist}: cannot import {e.name or e}: {self.install}") from None
            return self._loaded

    def no_path(self, path: str | None) -> None:
        if path is not None:
            raise SubjectUnavailable(f"{self.dist} takes no path (it is the installed package): got {path!r}")
