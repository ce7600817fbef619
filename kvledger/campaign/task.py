"""One task of a campaign and what became of it.

A task names a function by import path and its JSON arguments, so any worker (a local process or
a Ray worker on another machine) can run it from the task alone, and a failure found by it
replays from its record on a laptop. Statuses: `done` (it returned), `failed` (it raised: a bug in
the harness or the tool, with its traceback), `died` (its worker process was lost on both tries),
`hung` (it ran past its time limit and was stopped), `cancelled` (the campaign was interrupted).
"""

from __future__ import annotations

import importlib
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional

STATUSES = ("done", "failed", "died", "hung", "cancelled")
MAX_ATTEMPTS = 2  # a task whose worker dies is retried once, then reported


@dataclass(frozen=True)
class Task:
    key: str  # unique in its campaign, e.g. "fuzz/seed0/shard3"
    function: str  # "package.module:function", called as function(**args)
    args: Dict[str, Any] = field(default_factory=dict)
    time_limit: float = 600.0  # seconds of running before it is stopped and reported as hung

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass
class Outcome:
    key: str
    status: str
    value: Optional[Dict[str, Any]] = None  # what the function returned (done)
    error: Optional[str] = None  # a traceback (failed), or why the task was stopped
    attempts: int = 1
    seconds: float = 0.0  # of its last attempt

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def hung(cls, task: Task, attempt: int, seconds: float) -> Outcome:
        return cls(task.key, "hung", None, f"stopped after its time limit of {task.time_limit:g} s", attempt, seconds)

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> Outcome:
        if data.get("status") not in STATUSES:
            raise ValueError(f"outcome of {data.get('key')!r}: status must be one of {STATUSES}")
        return cls(**data)


def resolve(function: str) -> Any:
    module, _, name = function.partition(":")
    if not module or not name:
        raise ValueError(f"task function must be 'package.module:function', got {function!r}")
    return getattr(importlib.import_module(module), name)


def call(task: Task) -> Dict[str, Any]:
    """Run the task here; what the function returns must be a JSON-able dict."""
    value = resolve(task.function)(**task.args)
    if not isinstance(value, dict):
        raise TypeError(f"task {task.key}: {task.function} returned {type(value).__name__}, not a dict")
    return value


def failure_text() -> str:
    return traceback.format_exc()
