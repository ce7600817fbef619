"""The trace file: parsed into typed lines at the file boundary, written back byte for byte."""

import pytest

from kvledger.engine.ledger import trace
from kvledger.engine.ledger.ops import OpRecord, Prefill, Submit
from tests.support.paths import ROOT

HEAD = (
    '{"kvledger_trace": 2, "num_pages": 8, "page_size": 1, "cache_type": "radix", "table_slots": 2, "max_seq_len": 6}\n'
)


def test_every_stored_trace_reads_typed_and_writes_back_the_same_lines():
    paths = sorted((ROOT / "tests").rglob("*.jsonl"))
    assert len(paths) > 40
    for path in paths:
        text = path.read_text()
        header, ops = trace.loads(text, str(path))
        assert all(isinstance(op, OpRecord) for op in ops)
        assert trace.dumps(header, ops).splitlines()[1:] == text.splitlines()[1:], path  # v1 headers become v2


def test_a_bad_line_is_a_trace_error_naming_its_line_and_field():
    text = HEAD + '{"op": "submit", "uid": 0, "tokens": [1], "max_tokens": 1}\n{"op": "prefill", "budget": "x"}\n'
    with pytest.raises(trace.TraceError, match=r"t.jsonl:3: prefill: budget must be an integer"):
        trace.loads(text, "t.jsonl")
    with pytest.raises(trace.TraceError, match=r"t.jsonl:2: expect: unknown field 'batchh'"):
        trace.loads(HEAD + '{"op": "decode", "sample": [], "expect": {"batchh": []}}\n', "t.jsonl")


def test_typed_operations_and_records_are_written_as_their_lines():
    header, _ = trace.loads(HEAD)
    text = trace.dumps(header, [OpRecord(Submit(0, (1,), 1)), Prefill(1, (), ())])
    assert text.splitlines()[1:] == [
        '{"op": "submit", "uid": 0, "tokens": [1], "max_tokens": 1}',
        '{"op": "prefill", "budget": 1, "sample": [], "stop": []}',
    ]
