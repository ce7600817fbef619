"""The checker's seam (properties/target.py): both targets replay a trace, place their finding at its
operation, treat an invalid operation their own way, and say what a trace they write records."""

from __future__ import annotations

import pytest

from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import Abort, Finish, InvalidOp, OpRecord, OpResult, Prefill, Submit
from kvledger.engine.ledger.trace import Header, read
from kvledger.properties.subject import SubjectConfig
from kvledger.properties.target import LockstepTarget, SubjectTarget, config_of, header_of, replay
from kvledger.subjects.fast_zoo import patched
from tests.support.paths import ROOT
from tests.support.toy_block_subject import ToyBlockCache

HEADER = Header(num_pages=8, page_size=2, cache_type="radix", table_slots=4, max_seq_len=16)
SUBMIT = OpRecord(Submit(0, (1, 2, 3), 2))
PREFILL = OpRecord(Prefill(64, (7,)))


def test_a_lockstep_run_returns_typed_results_and_counts_its_steps():
    run = LockstepTarget().start(HEADER)
    assert run.apply(SUBMIT) == OpResult()
    assert run.apply(PREFILL.op) == OpResult(batch=(0,), refused=None)  # a bare operation will do
    assert run.step == 2 and run.ops == [SUBMIT, PREFILL]


def test_a_dict_line_is_parsed_once_at_the_entry():
    run = LockstepTarget().start(HEADER)
    run.apply({"op": "submit", "uid": 0, "tokens": [1, 2, 3], "max_tokens": 2})
    assert run.ops == [SUBMIT]
    with pytest.raises(InvalidOp, match="budget"):
        run.apply({"op": "prefill", "budget": "lots"})
    assert run.ops == [SUBMIT]


def test_lockstep_is_strict_and_a_subject_skips_an_invalid_operation():
    finish = OpRecord(Finish(5))
    with pytest.raises(InvalidOp) as e:
        replay(LockstepTarget(), HEADER, [SUBMIT, finish])
    assert e.value.step == 2
    toy = SubjectTarget(lambda config: ToyBlockCache(config), "toy")
    finding, run = replay(toy, HEADER, [SUBMIT, finish, PREFILL])
    assert finding is None and run is not None and run.ops == [SUBMIT, PREFILL]


def test_a_zoo_bug_is_planted_while_the_target_is_active_and_its_finding_placed():
    header, ops = read(ROOT / "tests/zoo_traces/free-list-lifo.jsonl")
    target = LockstepTarget("free-list-lifo", patch=patched)
    with target.active():
        finding, run = replay(target, header, ops)
    assert isinstance(finding, Finding) and finding.step == len(run.ops) and finding.op == run.ops[-1].to_json()
    assert str(finding).startswith(f"step {finding.step}, op ")
    finding, _ = replay(target, header, ops)  # not active: fast as it is
    assert finding is None


def test_a_subject_finding_names_its_operation_and_a_broken_build_is_a_finding():
    bad = [SUBMIT, PREFILL, OpRecord(Abort(0))]
    finding, run = replay(SubjectTarget(lambda config: ToyBlockCache(config, "abort-raises"), "toy"), HEADER, bad)
    assert finding is not None and finding.step == 3 and finding.op == {"op": "abort", "uid": 0} and run is not None

    def broken(config: SubjectConfig) -> ToyBlockCache:
        raise RuntimeError("no pool")

    finding, run = replay(SubjectTarget(broken, "broken"), HEADER, bad)
    assert run is None and finding.kind == "subject-raised:RuntimeError" and "no pool" in finding.detail


def test_what_a_trace_records():
    assert LockstepTarget().trace_header(HEADER, "kvledger explore").producer == "kvledger explore"
    toy = SubjectTarget(lambda config: ToyBlockCache(config), "toy")
    toy.start(HEADER)
    recorded = toy.trace_header(HEADER, "minimize")
    assert (recorded.subject, recorded.subject_version, recorded.producer) == ("toy", toy.version, "minimize")
    assert config_of(recorded) == config_of(HEADER) == SubjectConfig(8, 2, 16, 4)
    assert config_of(header_of(SubjectConfig(8, 2, 16, 4), None, "x", "toy", "1")) == SubjectConfig(8, 2, 16, 4)
