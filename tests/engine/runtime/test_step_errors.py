"""A forward pass that raises a real error (not injected): the engine ends that step's requests and
nothing else, the prefix cache keeps none of the KV the failed pass owed, and the ledger, the shadow
reference (--verify) and the idle check agree; errors that break the device are not contained."""

from __future__ import annotations

from typing import Callable, List, Optional

import pytest
import torch

from kvledger.engine.runtime.engine import Engine
from kvledger.engine.runtime.llm import LLM
from kvledger.fast import SamplingParams

PROMPTS = [[10 + 7 * i + j for j in range(5 + 3 * i)] for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def build(overlap: bool = False, prefill_budget: int = 24) -> LLM:
    return LLM(
        dummy_weights=True,
        kv_cache_tokens=32 * 16,
        max_seq_len=128,
        max_prefill_tokens=prefill_budget,
        verify=True,
        overlap=overlap,
    )


def fail_forward(engine: Engine, at_calls: List[int], make: Callable[[], Exception]) -> List[List[int]]:
    """Make the model's forward raise `make()` at the given calls (1-based); returns the uids of
    each failed call's batch."""
    real = engine.runner.forward
    calls, struck = [0], []

    def forward(batch, *args, **kwargs):
        calls[0] += 1
        if calls[0] in at_calls:
            struck.append([r.uid for r in batch.requests])
            raise make()
        return real(batch, *args, **kwargs)

    engine.runner.forward = forward  # type: ignore[method-assign]
    return struck


def settle(llm: LLM) -> None:
    llm.engine.check_idle()
    assert llm.shadow is not None
    llm.shadow.model.check()
    assert llm.shadow.steps == llm.engine.operations  # the reference heard every operation
    pages = llm.engine.page_stats()
    assert pages.owned == 0 and pages.locked_tokens == 0 and pages.free + pages.cached == pages.total


@pytest.fixture(scope="module")
def reference() -> List[List[int]]:
    return [o.token_ids for o in build().generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_real_forward_error_ends_its_batch_and_nothing_else(reference, overlap):
    llm = build(overlap)
    struck = fail_forward(llm.engine, [3], lambda: RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    outs = llm.generate(PROMPTS, GREEDY)
    assert len(struck) == 1
    hit = sorted(i for i, o in enumerate(outs) if o.finish_reason == "error")
    assert hit == sorted(struck[0]) and len(hit) < len(PROMPTS)
    for i, o in enumerate(outs):
        if i in hit:
            assert "forward pass failed: RuntimeError: mat1 and mat2" in str(o.error)
            assert o.token_ids == reference[i][: len(o.token_ids)]  # nothing from the failed pass
        else:
            assert o.error is None and o.token_ids == reference[i]
    assert llm.engine.contained == {"forward-error": 1}
    settle(llm)


def test_a_failed_prompt_chunk_ends_its_request_though_it_sampled_nothing():
    """A 40-token prompt under a 24-token budget: its first chunk fails, so it never samples."""
    llm = build()
    fail_forward(llm.engine, [1], lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    prompt = list(range(100, 140))
    (out,) = llm.generate([prompt], GREEDY)
    assert out.finish_reason == "error" and out.token_ids == [] and "OutOfMemoryError" in str(out.error)
    settle(llm)
    (again,) = llm.generate([prompt], GREEDY)  # the engine serves on: the same prompt runs whole
    assert again.error is None and len(again.token_ids) == GREEDY.max_tokens


def test_the_prefix_cache_keeps_nothing_the_failed_pass_owed(reference):
    """The failed prefill's prompt went to the prefix cache when its request ended; a later request
    with that prompt must recompute it, not read KV the failed pass never wrote."""
    llm = build()
    fail_forward(llm.engine, [1], lambda: RuntimeError("a kernel raised"))
    (failed,) = llm.generate([PROMPTS[5]], GREEDY)
    assert failed.finish_reason == "error"
    (later,) = llm.generate([PROMPTS[5]], GREEDY)
    assert later.cached_tokens == 0 and later.token_ids == reference[5]
    settle(llm)


def test_without_the_eviction_the_later_request_reads_unwritten_kv(reference, monkeypatch):
    """The planted bug: clean-up that leaves the prefix cache as it is hands the next request the
    failed pass's pages as a prefix hit, and its output departs from a fault-free run."""
    from kvledger.engine.ledger.cache_scheduler import CacheScheduler

    monkeypatch.setattr(CacheScheduler, "evictable_tokens", lambda self: 0)
    llm = build()
    fail_forward(llm.engine, [1], lambda: RuntimeError("a kernel raised"))
    llm.generate([PROMPTS[5]], GREEDY)
    (later,) = llm.generate([PROMPTS[5]], GREEDY)
    assert later.cached_tokens > 0 and later.token_ids != reference[5]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
        lambda: RuntimeError("CUDA error: device-side assert triggered"),
        lambda: RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"),
    ],
    ids=["accelerator-error", "device-side-assert", "cublas"],
)
def test_an_error_that_breaks_the_device_is_not_contained(make):
    llm = build()
    fail_forward(llm.engine, [2], make)
    with pytest.raises(RuntimeError) as raised:
        llm.generate(PROMPTS, GREEDY)
    assert type(raised.value) is type(make()) and llm.engine.contained == {}


def test_an_engine_told_not_to_contain_real_errors_raises_them():
    """As on tensor-parallel ranks (engine/runtime/build.py): a real error may strike one rank only."""
    llm = build()
    llm.engine.contain_errors = False
    fail_forward(llm.engine, [2], lambda: ValueError("a rank's forward raised"))
    with pytest.raises(ValueError, match="a rank's forward raised"):
        llm.generate(PROMPTS, GREEDY)


def first_error(outs) -> Optional[str]:
    return next((o.error for o in outs if o.error is not None), None)


def test_two_failed_steps_each_end_their_own_batch(reference):
    llm = build()
    struck = fail_forward(llm.engine, [2, 5], lambda: RuntimeError("again"))
    outs = llm.generate(PROMPTS, GREEDY)
    ended = {i for i, o in enumerate(outs) if o.finish_reason == "error"}
    assert ended == {u for batch in struck for u in batch} and len(struck) == 2
    assert "again" in str(first_error(outs))
    assert all(o.token_ids == reference[i] for i, o in enumerate(outs) if i not in ended)
    assert llm.engine.contained == {"forward-error": 2}
    settle(llm)
