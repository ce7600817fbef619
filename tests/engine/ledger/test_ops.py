"""Cache operations are typed: a trace line parses into its dataclass with every field checked,
and turns back into the same line."""

import pytest

from kvledger import reference
from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.engine.ledger.ops import (
    Abort,
    Decode,
    Evict,
    Expect,
    Finish,
    InvalidOp,
    OpResult,
    Prefill,
    Probe,
    Submit,
    dispatch,
    parse,
    parse_line,
    to_json,
)


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


@pytest.mark.parametrize(
    "line",
    [
        {"op": "prefill", "budget": 1, "sample": [], "expect": {"batch": [], "rejected": None}},
        {"op": "prefill", "budget": 9, "sample": [4], "stop": [], "expect": {"batch": [2, 0], "preempted": [1]}},
        {"op": "abort", "uid": 3, "expect": {"where": "waiting"}},
        {"op": "probe", "tokens": [1], "expect": {"cached_len": 1}},
        {"op": "decode", "sample": [5]},
    ],
)
def test_a_whole_line_round_trips_with_its_expect_and_the_fields_it_leaves_out(line):
    record = parse_line(line)
    assert record.to_json() == line and list(record.to_json()) == list(line)
    assert record.op == parse(line)


def test_an_expect_is_checked_against_a_result_under_the_names_the_line_wrote():
    expect = parse_line({"op": "prefill", "budget": 1, "expect": {"batch": [2], "rejected": 4}}).expect
    assert expect is not None and expect.names == ("batch", "rejected")
    assert expect.matches(OpResult(batch=(2,), refused=4, preempted=(1,)))  # fields it did not record
    assert not expect.matches(OpResult(batch=(2,), refused=None))
    assert Expect.of_batch([1, 2]).as_dict() == {"batch": [1, 2]}
    assert Expect.of_batch([1], [3]).as_dict() == {"batch": [1], "preempted": [3]}


@pytest.mark.parametrize(
    "expect,words",
    [
        ({"batchh": [1]}, "expect: unknown field 'batchh'"),
        ({"batch": 1}, "expect: batch must be a list of integers"),
        ({"cached_len": "1"}, "expect: cached_len must be an integer"),
        ({"where": 1}, "expect: where must be a string"),
    ],
)
def test_a_bad_expect_is_an_invalid_op_naming_the_field(expect, words):
    with pytest.raises(InvalidOp, match=words):
        parse_line({"op": "decode", "expect": expect})


def test_one_dispatch_calls_the_method_of_each_operation():
    calls = []

    class Handler:
        def __getattr__(self, name):
            return lambda *args: calls.append((name, args)) or OpResult()

    for op in [Submit(1, (2,), 3), Prefill(4, (5,), (1,)), Decode((6,)), Finish(1), Abort(2), Evict(7), Probe((8,))]:
        assert dispatch(op, Handler()) == OpResult()
    assert calls == [
        ("submit", (1, (2,), 3)),
        ("prefill", (4, (5,), (1,))),
        ("decode", ((6,), ())),
        ("finish", (1,)),
        ("abort", (2,)),
        ("evict", (7,)),
        ("probe", ((8,),)),
    ]
    with pytest.raises(InvalidOp, match="not a cache operation"):
        dispatch("submit", Handler())  # type: ignore[arg-type]
