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
from typing import Any, Callable, Dict, Iterable, List, Sequence, Tuple


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


def edited_function(edit: SourceEdit | Sequence[SourceEdit], module: types.ModuleType | None = None) -> Callable:
    """The edited copy of the edit's target, compiled in its module's globals; several edits of one
    target are applied in order to one copy (a zoo bug on top of a fix). `module` replaces the
    import of the target's module (for a subject loaded under another name)."""
    edits = [edit] if isinstance(edit, SourceEdit) else list(edit)
    edit = edits[0]
    if any(e.target != edit.target for e in edits):
        raise EditError(f"{', '.join(e.name for e in edits)}: one copy takes edits of one target")
    module_name, path = edit.split()
    if module is None:
        module = importlib.import_module(module_name)
    original = _resolve(module, path)
    func = inspect.unwrap(original)
    source = textwrap.dedent(inspect.getsource(func))
    for e in edits:
        found = source.count(e.old)
        if found != 1:
            raise EditError(f"{e.name}: the text to replace occurs {found} times in {e.target}, not once")
        source = source.replace(e.old, e.new)
    names = "+".join(e.name for e in edits)
    namespace: Dict[str, Any] = {}
    free = func.__code__.co_freevars
    if free:
        # The copy must close over the same free variables: zero-argument super() reads its class
        # from a `__class__` closure cell (a global of that name does not do), so the copy is
        # compiled inside a function that takes them as parameters and returns it.
        source = (
            f"def __kvledger_closure__({', '.join(free)}):\n{textwrap.indent(source, '    ')}\n    return {path[-1]}\n"
        )
    code = compile(source, f"<{names}: edited {edit.target}>", "exec")
    exec(code, dict(func.__globals__), namespace)
    if free:
        assert func.__closure__ is not None
        edited = namespace["__kvledger_closure__"](*(cell.cell_contents for cell in func.__closure__))
    else:
        edited = namespace[path[-1]]
    edited.__kvledger_edit__ = names
    return edited


def bind(obj: Any, edits: Iterable[SourceEdit], module: types.ModuleType | None = None) -> None:
    """Put the edited methods on `obj` alone (instance attributes shadow the class's); edits of
    the same method go into one copy, in order."""
    bound: Dict[str, List[SourceEdit]] = obj.__dict__.setdefault("__kvledger_edits__", {})
    touched = []
    for edit in edits:  # an earlier bind's edits of the same method stay in the new copy
        bound.setdefault(edit.target, []).append(edit)
        touched.append(edit.target)
    for target in dict.fromkeys(touched):
        group = bound[target]
        func = edited_function(group, module)
        if isinstance(func, classmethod):
            setattr(obj, group[0].split()[1][-1], types.MethodType(func.__func__, type(obj)))
        elif isinstance(func, staticmethod):
            setattr(obj, group[0].split()[1][-1], func.__func__)
        else:
            setattr(obj, group[0].split()[1][-1], types.MethodType(func, obj))


def bind_to_instances(edits: Iterable[SourceEdit], owners: Sequence[Any], what: str) -> None:
    """Each edit on every object of `owners` that is an instance of the edit's target class (a
    subject's parts: a manager, its pool, its queue...); EditError when none is. `what` names the
    subject in the message."""
    for edit in edits:
        module_name, path = edit.split()
        owner_class: Any = importlib.import_module(module_name)
        for part in path[:-1]:
            owner_class = getattr(owner_class, part, None)
        found = [o for o in owners if isinstance(owner_class, type) and isinstance(o, owner_class)]
        if not found:
            raise EditError(f"{edit.name}: no object of this {what} is a {edit.target.rpartition('.')[0]}")
        for owner in found:
            bind(owner, [edit])
