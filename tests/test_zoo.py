"""The bug zoo, CI-sized: every bug is caught by its stored minimized trace, the same trace
replays clean on the real code, and `patched` leaves the fast classes exactly as it found them.

The traces in tests/zoo_traces/ come from `kvledger zoo` (minimized failing traces); the full
measurement (Hypothesis CI profile and fuzzer per bug) is `kvledger zoo`, not a test.
"""

from pathlib import Path

import pytest

from kvledger.engine import trace
from kvledger.properties.lockstep import Divergence, replay
from kvledger.tools.zoo import BUGS, patched
from kvledger.tools.zoo_run import ZooRow, format_table

TRACES = Path(__file__).parent / "zoo_traces"


def test_every_bug_has_a_trace_and_every_trace_a_bug():
    stored = {p.stem for p in TRACES.glob("*.jsonl")}
    assert stored == set(BUGS)
    assert len(BUGS) >= 15


@pytest.mark.parametrize("name", sorted(BUGS))
def test_bug_is_caught_by_its_trace(name):
    header, ops = trace.read(TRACES / f"{name}.jsonl")
    with patched(name):
        with pytest.raises(Divergence):
            replay(header, ops)
    replay(header, ops)  # without the bug the same operations agree with the model


def _current(patches):
    return [(cls, attr, cls.__dict__.get(attr)) for cls, attr, _ in patches]


@pytest.mark.parametrize("name", sorted(BUGS))
def test_each_bug_replaces_an_existing_method(name):
    # a zoo bug is an edit of real code: it must replace something the class defines
    for cls, attr, value in BUGS[name].patches():
        assert attr in cls.__dict__, f"{name}: {cls.__name__}.{attr} does not exist"
        assert value is not cls.__dict__[attr]


def test_patched_restores_the_original_methods():
    for name, bug in BUGS.items():
        patches = bug.patches()
        before = _current(patches)
        with patched(name):
            during = _current(patches)
        assert _current(patches) == before, name
        assert all(d[2] is not b[2] for d, b in zip(during, before)), name


def test_patched_restores_after_an_exception():
    name = sorted(BUGS)[0]
    before = _current(BUGS[name].patches())
    with pytest.raises(ZeroDivisionError):
        with patched(name):
            1 / 0
    assert _current(BUGS[name].patches()) == before


def test_patched_none_and_unknown():
    with patched(None):
        pass
    with pytest.raises(KeyError, match="unknown bug"):
        with patched("no-such-bug"):
            pass


def test_zoo_table_marks_escapes():
    rows = [ZooRow("a", "x", hyp_caught=True, hyp_seconds=1.25, fuzz_caught=False, min_ops=3),
            ZooRow("b", "y", hyp_caught=False, fuzz_caught=None)]
    table = format_table(rows)
    assert "hypothesis" in table.splitlines()[2] and "1.2s" in table
    assert "ESCAPED" in table.splitlines()[3]
    assert [r.escaped for r in rows] == [False, True]


def test_replay_cli_with_a_bug(capsys):
    """`kvledger replay TRACE --bug NAME` diverges (exit 1) where the plain replay agrees (exit 0);
    an unknown bug is a clear error (exit 2)."""
    from kvledger.tools.replay import replay_file

    trace = str(TRACES / "allocate-floor-pages.jsonl")
    assert replay_file(trace) == 0
    assert replay_file(trace, bug="allocate-floor-pages") == 1
    assert "DIVERGED" in capsys.readouterr().out
    assert replay_file(trace, bug="no-such-bug") == 2
    assert "unknown bug" in capsys.readouterr().err
