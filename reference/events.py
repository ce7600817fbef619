"""Named rare events the model passes through, so a test can prove they were reached.

A no-op unless a listener is set (the property harness sets Hypothesis' `event`).
"""

from typing import Callable, Optional

_listener: Optional[Callable[[str], None]] = None


def set_listener(listener: Optional[Callable[[str], None]]) -> None:
    global _listener
    _listener = listener


def note(name: str) -> None:
    if _listener is not None:
        _listener(name)
