"""Fixtures the subject tests share."""

from __future__ import annotations

import pytest

from kvledger.properties.subject import SubjectUnavailable


@pytest.fixture(scope="module")
def sglang_importable() -> None:
    """Skip the module's tests, with the reason, where SGLang 0.5.23 is not installed or loads not."""
    from kvledger.subjects import sglang

    installed, _, detail = sglang.probe()
    if not installed:
        pytest.skip(detail)
    try:
        sglang.load()
    except SubjectUnavailable as e:
        pytest.skip(str(e))
