"""Cache operations are typed: a trace line parses into its dataclass with every field checked,
and turns back into the same line."""

import pytest

from kvledger import reference
from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.engine.ledger.ops import Decode, InvalidOp, Prefill, Submit, parse, to_json


@pytest.mark.parametrize(
    "line",
    [
        {"op": "submit", "uid": 3, "tokens": [1, 2, 3], "max_tokens": 4},
        {"op": "prefill", "budget": 64, "sample": [7], "stop": [3]},
        {"op": "decode", "sample": [], "stop": []},
        {"op": "finish", "uid": 1},
        {"op": "abort", "uid": 2},
        {"op": "evict", "tokens": 16},
        {"op": "probe", "tokens": [1, 2]},
    ],
)
def test_a_line_round_trips(line):
    assert to_json(parse(line)) == line
    assert parse({**line, "expect": {"batch": [1]}}) == parse(line)  # expect belongs to the trace


@pytest.mark.parametrize(
    "line,words",
    [
        ({"op": "fly"}, "unknown operation"),
        ({"op": "submit", "uid": 1, "tokens": [1], "max_token": 4}, "unknown field(s) ['max_token']"),
        ({"op": "submit", "uid": 1, "tokens": [1]}, "missing field 'max_tokens'"),
        ({"op": "submit", "uid": "1", "tokens": [1], "max_tokens": 4}, "uid must be an integer"),
        ({"op": "submit", "uid": True, "tokens": [1], "max_tokens": 4}, "uid must be an integer"),
        ({"op": "prefill", "budget": 8, "sample": "7"}, "sample must be a list of integers"),
        ({"op": "probe", "tokens": [1, 2.5]}, "tokens must be a list of integers"),
    ],
)
def test_a_bad_line_is_an_invalid_op_naming_the_field(line, words):
    with pytest.raises(
        InvalidOp, match=words.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")
    ):
        parse(line)


def test_the_driver_takes_typed_operations_and_trace_lines_alike():
    kw = dict(num_pages=8, page_size=4, cache_type="radix", table_slots=4, max_seq_len=32)
    typed, lines = CacheScheduler(reference, **kw), CacheScheduler(reference, **kw)
    ops = [Submit(1, (5, 6, 7, 8, 9), 3), Prefill(64, (11,)), Decode((12,)), Decode((13,))]
    for op in ops:
        assert typed.apply(op) == lines.apply(to_json(op))
    assert typed.snapshot() == lines.snapshot()
    with pytest.raises(InvalidOp):
        typed.apply({"op": "decode", "samples": [1]})
