"""Injected faults inside a step, in-process (dummy weights, --verify): a contained fault ends exactly
the requests it touched, the others' outputs equal a fault-free run, no page leaks, and the shadow
reference agrees; an uncontainable one raises out of the step; a rollback skipped is caught."""

from __future__ import annotations

from typing import List, Optional

import pytest

from kvledger.engine.ledger.ops import InvalidOp
from kvledger.engine.runtime.faults import UncontainableFault
from kvledger.engine.runtime.llm import LLM
from kvledger.engine.runtime.step_faults import StepFaults
from kvledger.fast import SamplingParams

PROMPTS = [[10 + 7 * i + j for j in range(5 + 3 * i)] for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def build(spec: Optional[str], overlap: bool = False) -> LLM:
    # a prefill budget of 24 tokens admits the six prompts over several steps, so a step holds some
    return LLM(
        dummy_weights=True,
        kv_cache_tokens=32 * 16,
        max_seq_len=128,
        max_prefill_tokens=24,
        verify=True,
        inject_fault=spec,
        overlap=overlap,
    )


def outputs(llm: LLM, params=GREEDY):
    outs = llm.generate(PROMPTS, params)
    llm.engine.check_idle()
    assert llm.shadow is not None
    llm.shadow.model.check()  # the reference's own invariants, on the same operations
    return outs


@pytest.fixture(scope="module")
def reference() -> List[List[int]]:
    return [o.token_ids for o in outputs(build(None))]


def ended(outs) -> List[int]:
    return [i for i, o in enumerate(outs) if o.finish_reason == "error"]


def test_forward_raise_ends_the_batch_it_struck_and_nothing_else(reference):
    llm = build("forward-raise@step=3")
    outs = outputs(llm)
    hit = ended(outs)
    assert hit and len(hit) < len(PROMPTS)  # the third step's batch, not every request
    for i, o in enumerate(outs):
        if i in hit:
            assert "injected forward-raise" in str(o.error) and o.token_ids == reference[i][: len(o.token_ids)]
        else:
            assert o.error is None and o.token_ids == reference[i]
    pages = llm.engine.page_stats()
    assert pages.owned == 0 and pages.locked_tokens == 0 and pages.free + pages.cached == pages.total
    assert llm.shadow is not None and llm.shadow.steps == llm.engine.operations
    assert llm.engine.faults is not None and llm.engine.faults.struck == {"forward-raise": 1}


def test_alloc_refuse_ends_only_the_request_it_refused(reference):
    llm = build("alloc-refuse@step=2,request=3")
    outs = outputs(llm)
    assert ended(outs) == [3] and "refused the pages request 3" in str(outs[3].error)
    assert [o.token_ids for i, o in enumerate(outs) if i != 3] == [r for i, r in enumerate(reference) if i != 3]
    assert llm.engine.page_stats().owned == 0


def test_the_seed_picks_the_refused_request_and_the_same_seed_the_same_one():
    picks = []
    for _ in range(2):
        outs = outputs(build("alloc-refuse@step=4,seed=11"))
        picks.append(ended(outs))
    assert len(picks[0]) == 1 and picks[0] == picks[1]


def test_faults_that_fire_several_times_each_end_their_own_step(reference):
    llm = build("alloc-refuse@step=2,times=3,seed=5")
    outs = outputs(llm)
    assert len(ended(outs)) == 3
    assert all(o.token_ids == reference[i] for i, o in enumerate(outs) if o.error is None)


def test_a_short_step_stall_only_delays(reference):
    llm = build("step-stall@step=2,seconds=0.01")
    assert [o.token_ids for o in outputs(llm)] == reference
    assert llm.engine.faults is not None and llm.engine.faults.struck == {"step-stall": 1}


def test_with_overlap_the_step_in_flight_lands_and_the_rollback_holds():
    """Overlap (the CUDA default, here on the CPU): the failing step is launched while the previous
    one is in flight, on placeholders; it rolls back, the previous lands, sampled rows included."""
    sampled = [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, seed=i) for i in range(6)]
    mixed = [GREEDY if i % 2 else sampled[i] for i in range(6)]
    reference = [o.token_ids for o in outputs(build(None, overlap=True), mixed)]
    for spec, hit in (("forward-raise@step=3", None), ("alloc-refuse@step=7,times=2,seed=4", 2)):
        llm = build(spec, overlap=True)
        outs = outputs(llm, mixed)
        gone = ended(outs)
        assert gone and len(gone) < len(PROMPTS) and (hit is None or len(gone) == hit)
        assert all(o.token_ids == reference[i] for i, o in enumerate(outs) if i not in gone)
        assert all(o.token_ids == reference[i][: len(o.token_ids)] for i, o in enumerate(outs))
        assert llm.engine.page_stats().owned == 0
        assert llm.shadow is not None and llm.shadow.steps == llm.engine.operations


def test_cuda_poison_raises_out_of_the_step():
    llm = build("cuda-poison@step=2")
    with pytest.raises(UncontainableFault, match="illegal memory access"):
        llm.generate(PROMPTS, GREEDY)


def test_without_a_plan_for_its_steps_the_engine_holds_none():
    assert build(None).engine.faults is None
    assert build("rank-kill@step=3,rank=1").engine.faults is None  # the ranks' (engine/distributed)


def test_a_step_not_rolled_back_is_caught_by_the_ledger(monkeypatch):
    """The planted bug: containment of a refused allocation that aborts the request without rolling
    the step back leaves it admitted mid-step, neither waiting nor running; the ledger refuses the abort."""
    monkeypatch.setattr(StepFaults, "_roll_back", lambda self, checkpoint, batch, attempted_admission: None)
    llm = build("alloc-refuse@step=1,request=0")
    with pytest.raises(InvalidOp, match="neither waiting nor running"):
        outputs(llm)
