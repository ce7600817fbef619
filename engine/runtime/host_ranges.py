"""Named host ranges for torch.profiler: `kvledger.schedule`, `kvledger.complete` and
`kvledger.wait`, which the benchmarks' decode profile reads (kvledger/bench/decode_profile.py).

A `record_function` costs about 6 us even when no profiler records, and a step opens three, so a
range is opened only while one does."""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch.profiler import record_function

_NO_RANGE = contextlib.nullcontext()


def host_range(name: str) -> ContextManager:
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", True):
        return record_function(name)
    return _NO_RANGE
