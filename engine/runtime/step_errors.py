"""A step whose forward pass raised: which errors the engine contains, and the failed step it completes.

A forward pass that raises (a kernel's Python-side error, an out-of-memory, a shape the model
refuses; or the injected forward-raise, which raises at the same place) leaves the ledger halfway
through the step's operation: the batch is scheduled, its pages are allocated, and the observers
have heard nothing yet. Taking a checkpoint before every step to undo that costs far more than a
step (a deep copy of the scheduler, 0.2 s at 256 running requests on the CPU: docs/serving.md), so
the engine instead completes the step as a failed one, by ordinary operations the observers hear
of like any other:

1. the step's operation completes with every sampled row stopped and failed (placeholder tokens,
   none of them delivered): those requests end with the error;
2. its rows that were not sampled (a prompt chunk that does not end the prompt) are aborted;
3. the prefix cache drops every entry no live request holds (`Evict`), since the ended requests
   handed it KV positions the failed pass may have left unwritten; the KV of requests that go on
   was written by earlier steps and stays;
4. the ledger's own check runs, and a state it refuses makes the error uncontainable after all.

Requests outside the batch go on unchanged. Errors that say the device itself is broken (a CUDA
error or device-side assert: the context cannot be trusted) are never contained, nor is any error
on tensor-parallel ranks unless it was injected (every rank strikes an injected one alike; a real
one may strike one rank only, and the others would wait in a collective that never meets).
"""

from __future__ import annotations

import logging
from typing import Dict, List

import torch

from kvledger.engine.runtime.faults import InjectedFault, UncontainableFault
from kvledger.engine.runtime.overlap import LaunchedStep
from kvledger.engine.runtime.scheduler import Batch

__all__ = ["FORWARD_ERROR", "contains", "failed_step", "device_is_broken"]

log = logging.getLogger("kvledger.faults")

FORWARD_ERROR = "forward-error"  # the fault kind a genuine (not injected) forward error is counted as
# what the CUDA runtime and its libraries say when the device context is lost or corrupt
_BROKEN_DEVICE = ("CUDA error", "device-side assert", "CUBLAS_STATUS", "CUDNN_STATUS", "cuDNN error", "NCCL error")


def device_is_broken(error: BaseException) -> bool:
    """Whether `error` says the device context can no longer be trusted (an out-of-memory does not)."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    if isinstance(error, torch.AcceleratorError):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error) for s in _BROKEN_DEVICE)


def contains(error: Exception, genuine_allowed: bool) -> bool:
    """Whether the engine contains `error`, raised by a step's forward pass. `genuine_allowed`: the
    engine may contain errors nobody injected (False on tensor-parallel ranks)."""
    if isinstance(error, UncontainableFault) or device_is_broken(error):
        return False
    return isinstance(error, InjectedFault) or genuine_allowed


def failed_step(batch: Batch, error: Exception) -> LaunchedStep:
    """The step as launched, failed: placeholder tokens on every sampled row, each failed with the
    error's message (the engine completes it, delivers the errors, then cleans up)."""
    message = _message(error)
    rows = len(batch.sampled)
    step = LaunchedStep(batch, torch.empty(0), torch.zeros(rows, dtype=torch.long))
    step.values = [0] * rows
    failed: Dict[int, str] = {batch.requests[i].uid: message for i in batch.sampled}
    step.failed = failed
    step.error = message
    return step


def unsampled(step: LaunchedStep) -> List[int]:
    """The uids of the failed step's rows that sampled nothing (a prompt chunk): they are aborted."""
    sampled = set(step.sampled)
    return [r.uid for i, r in enumerate(step.requests) if i not in sampled]


def _message(error: Exception) -> str:
    if isinstance(error, InjectedFault):
        return str(error)
    return f"the model's forward pass failed: {type(error).__name__}: {str(error)[:300]}"
