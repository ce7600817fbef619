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


def wait_for(marker: str) -> Dict[str, int]:
    """Runs until the test creates `marker`: a task that cannot end before the test says so (or
    its campaign process is gone: an orphan would wait forever)."""
    parent = os.getppid()
    while not Path(marker).exists():
        if os.getppid() != parent:
            raise RuntimeError("the campaign that ran this task is gone")
        time.sleep(0.05)
    return {"waited": 1}


def run_until_interrupted(directory: str, marker: str) -> int:
    """`python -c` driver for the Ctrl-C test: a quick task, then one that waits for `marker`,
    then another quick one, on one local worker, through the checker's campaign runner.

    Ctrl-C is Python's KeyboardInterrupt here even where the test runner's parent ignores SIGINT
    (a job a shell starts in the background inherits SIGINT ignored, and so do its children): at
    a terminal, Ctrl-C reaches the campaign, and that is what the test models."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from kvledger.campaign import CampaignDir, LocalExecutor, Task
    from kvledger.checker import campaigns

    f = "tests.support.campaign_tasks"
    tasks = [
        Task("first", f"{f}:square", {"x": 1}),
        Task("waits", f"{f}:wait_for", {"marker": marker}),
        Task("last", f"{f}:square", {"x": 2}),
    ]
    text, code = campaigns.run(
        "test", {}, tasks, LocalExecutor(1), CampaignDir(directory), lambda run: (f"{len(run.outcomes)} done", 0), None
    )
    print(text)
    return code
