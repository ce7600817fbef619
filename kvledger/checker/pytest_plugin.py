"""kvledger's pytest plugin: the `kvledger_check` fixture, which runs
`kvledger.checker.testing.check_subject` with the test's `tmp_path` as the folder of the traces.

A project opts in with `pytest_plugins = ["kvledger.checker.pytest_plugin"]` in its conftest.py. It
is deliberately not a `pytest11` entry point: pytest rewrites the asserts of every module of a
distribution that registers one, which would change the bytecode of kvledger's own cache managers
(fast's zoo rebuilds their methods from source and compares) in every pytest session on the machine.
The module imports nothing at load time: the checker (Hypothesis, numpy) loads when a test first asks for the fixture.
It holds no literal either: a derandomized Hypothesis run draws from the constants of every loaded
local module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import pytest


@pytest.fixture
def kvledger_check(tmp_path: Path) -> Callable[..., str]:
    """`kvledger_check(subject, **options)`: `check_subject(subject, out_dir=tmp_path, **options)`,
    which fails the test with the minimized trace (a `SubjectFinding`)."""

    def check(subject: Any, *, out_dir: Optional[Path] = None, **options: Any) -> str:
        from kvledger.checker.testing import check_subject

        return check_subject(subject, out_dir=tmp_path if out_dir is None else out_dir, **options)

    return check
