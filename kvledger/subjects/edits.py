"""Single-edit copies of a subject's code: the third-party zoos and the upstream-style fixes.

An edit names one function or method of the subject's source (`module:Class.method`), the exact
text to replace (it must occur exactly once) and the text that replaces it. `edited_function`
compiles the edited source in the module's own globals, so the copy sees the same imports and
helpers as the original; `bind` puts it on one object, so the installed package, its files and
every other instance stay as they were (the zoo runs a copy, never the package).
"""

from __future__ import annotations

import importlib
import inspect
import textwrap
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Tuple


class EditError(ValueError):
    """An edit that does not apply to this version of the subject (its text is not found once)."""


@dataclass(frozen=True)
class SourceEdit:
    name: str  # the zoo name, e.g. "nanovllm-deallocate-skips-last"
    target: str  # "package.module:Class.method" or "package.module:function"
    old: str
    new: str
    why: str  # the realistic mistake this edit models

    def split(self) -> Tuple[str, Tuple[str, ...]]:
        module, _, path = self.target.partition(":")
        if not module or not path:
            raise EditError(f"{self.name}: target {self.target!r} is not 'module:Class.method'")
        return module, tuple(path.split("."))


def _resolve(module: types.ModuleType, path: Tuple[str, ...]) -> Any:
    obj: Any = module
    for part in path:
        obj = getattr(obj, part)
    return obj


def edited_function(edit: SourceEdit, module: types.ModuleType | None = None) -> Callable:
    """The edited copy of the edit's target, compiled in its module's globals. `module` replaces
    the import of the target's module (for a subject loaded under another name)."""
    module_name, path = edit.split()
    if module is None:
        module = importlib.import_module(module_name)
    original = _resolve(module, path)
    func = inspect.unwrap(original)
    source = textwrap.dedent(inspect.getsource(func))
    found = source.count(edit.old)
    if found != 1:
        raise EditError(f"{edit.name}: the text to replace occurs {found} times in {edit.target}, not once")
    source = source.replace(edit.old, edit.new)
    namespace: Dict[str, Any] = {}
    code = compile(source, f"<{edit.name}: edited {edit.target}>", "exec")
    globals_ = dict(func.__globals__)
    if func.__closure__:  # zero-argument super() needs __class__ in scope
        for name, cell in zip(func.__code__.co_freevars, func.__closure__):
            globals_[name] = cell.cell_contents
    exec(code, globals_, namespace)
    edited = namespace[path[-1]]
    edited.__kvledger_edit__ = edit.name
    return edited


def bind(obj: Any, edits: Iterable[SourceEdit], module: types.ModuleType | None = None) -> None:
    """Put the edited methods on `obj` alone (instance attributes shadow the class's)."""
    for edit in edits:
        func = edited_function(edit, module)
        setattr(obj, edit.split()[1][-1], types.MethodType(func, obj))
