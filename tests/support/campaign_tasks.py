"""Task functions for the campaign tests: each misbehaves in one way a real task can."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Dict


def square(x: int) -> Dict[str, int]:
    return {"x": x, "square": x * x, "pid": os.getpid()}


def die_once(marker: str) -> Dict[str, int]:
    """Killed mid-run on its first try (as by the OOM killer), fine on its second."""
    path = Path(marker)
    if not path.exists():
        path.write_text("killed once")
        os.kill(os.getpid(), signal.SIGKILL)
    return {"survived": 1}


def always_die() -> Dict[str, int]:
    os.kill(os.getpid(), signal.SIGKILL)
    return {}


def hang(seconds: float) -> Dict[str, int]:
    time.sleep(seconds)
    return {"slept": 1}


def broken() -> Dict[str, int]:
    raise ValueError("a bug in the task itself")
