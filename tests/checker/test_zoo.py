"""The bug zoo, CI-sized: every bug is the live fast method plus only its declared edits (an edit
whose text is gone fails loudly), every bug is caught by its stored minimized trace, the same trace
replays clean on the real code, and `patched` leaves the fast classes exactly as it found them.

The traces in tests/zoo_traces/ come from `kvledger zoo` (minimized failing traces); the full
measurement (Hypothesis CI profile and fuzzer per bug) is `kvledger zoo`, not a test.
"""

import dis
import inspect
import textwrap
from dataclasses import replace

import pytest

from kvledger import fast
from kvledger.checker.audit.zoo_run import ZooRow, format_table
from kvledger.engine.ledger import trace
from kvledger.properties.lockstep import Finding, replay
from kvledger.subjects.fast_zoo import BUGS, Bug, ZooEditError, patched
from tests.support.paths import ROOT, ZOO_TRACES

TRACES = ZOO_TRACES


def test_every_bug_has_a_trace_and_every_trace_a_bug():
    stored = {p.stem for p in TRACES.glob("*.jsonl")}
    assert stored == set(BUGS)
    assert len(BUGS) >= 15


@pytest.mark.parametrize("name", sorted(BUGS))
def test_bug_is_caught_by_its_trace(name):
    header, ops = trace.read(TRACES / f"{name}.jsonl")
    with patched(name):
        with pytest.raises(Finding):
            replay(header, ops)
    replay(header, ops)  # without the bug the same operations agree with the model


def _current(patches):
    return [(cls, attr, cls.__dict__.get(attr)) for cls, attr, _ in patches]


def _function(value):
    if isinstance(value, property):
        return value.fget
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def _instructions(code):
    """(operation, argument) pairs, jumps by instruction index. 3.11 compiles `torch.tensor(...)`
    to LOAD_ATTR in a module that imports torch but to LOAD_METHOD in the method's source alone
    (the same call): both count as LOAD_ATTR."""
    ins = list(dis.get_instructions(code))
    index = {i.offset: n for n, i in enumerate(ins)}
    jumps = set(dis.hasjrel) | set(dis.hasjabs)
    return [
        (
            "LOAD_ATTR" if i.opname == "LOAD_METHOD" else i.opname,
            index[i.argval] if i.opcode in jumps else _instructions(i.argval) if inspect.iscode(i.argval) else i.argval,
        )
        for i in ins
    ]


@pytest.mark.parametrize("name", sorted(BUGS))
def test_bug_is_the_live_method_with_only_its_declared_edits(name):
    """The patched function's source is the live method's source with the declared edits, and
    nothing else: undoing the edits gives back the live source."""
    bug = BUGS[name]
    [(cls, attr, value)] = bug.patches()
    assert (cls, attr) == (bug.target, bug.method)
    assert type(value) is type(cls.__dict__[attr])  # a property stays a property
    live = _function(cls.__dict__[attr])
    buggy = _function(value)
    live_src = textwrap.dedent(inspect.getsource(live))
    buggy_src = inspect.getsource(buggy)

    expected = live_src
    for old, new in bug.edits:
        assert live_src.count(old) == 1, f"{name}: {old!r}"
        assert "# BUG:" in new, f"{name}: the edit {new!r} carries no # BUG: marker"
        expected = expected.replace(old, new)
    assert buggy_src == expected
    undone = buggy_src
    for old, new in reversed(bug.edits):
        assert undone.count(new) == 1
        undone = undone.replace(new, old)
    assert undone == live_src

    assert buggy.__globals__ is live.__globals__  # names resolve as in the live module
    assert _instructions(buggy.__code__) != _instructions(live.__code__), f"{name}: no code changed"


@pytest.mark.parametrize("name", sorted(BUGS))
def test_without_edits_the_mechanism_rebuilds_the_live_method(name):
    bug = BUGS[name]
    [(cls, attr, value)] = replace(bug, edits=()).patches()
    live = cls.__dict__[attr]
    assert type(value) is type(live)
    assert _instructions(_function(value).__code__) == _instructions(_function(live).__code__)


def test_an_edit_whose_text_is_gone_fails_loudly():
    bogus = Bug(
        "bogus",
        "test",
        "an edit of text cache_req does not have",
        fast.CacheManager,
        "cache_req",
        (("self.unlock(old)", "self.unlock(new)  # BUG: fine"), ("self.no_such_call()", "pass  # BUG: stale")),
    )
    with pytest.raises(ZooEditError, match=r"'bogus'.*CacheManager\.cache_req.*'self\.no_such_call\(\)' 0 times"):
        bogus.patches()


def test_an_edit_whose_text_is_ambiguous_fails_loudly():
    twice = Bug(
        "twice",
        "test",
        "the admission check occurs twice",
        fast.PrefillAdder,
        "_try_allocate_one",
        (("if need + self.reserved_size > cm.available_size:", "if False:  # BUG: which one?"),),
    )
    with pytest.raises(ZooEditError, match="2 times"):
        twice.patches()


def test_a_comment_may_not_swallow_the_rest_of_a_line():
    swallow = Bug(
        "swallow", "test", "", fast.CacheManager, "match_req", (("req.input_ids", "req.input_ids  # BUG: oops"),)
    )
    with pytest.raises(ZooEditError, match="swallow"):
        swallow.patches()


def test_a_failing_bug_leaves_the_classes_alone(monkeypatch):
    before = fast.CacheManager.__dict__["cache_req"]
    monkeypatch.setitem(
        BUGS, "bogus", Bug("bogus", "test", "", fast.CacheManager, "cache_req", (("no such text", "x  # BUG: stale"),))
    )
    with pytest.raises(ZooEditError):
        with patched("bogus"):
            pass
    assert fast.CacheManager.__dict__["cache_req"] is before


def test_an_inherited_method_is_patched_on_the_subclass_and_removed_after(monkeypatch):
    class Sub(fast.TableManager):
        pass

    monkeypatch.setitem(
        BUGS,
        "sub-leak",
        Bug("sub-leak", "test", "", Sub, "free", (("self._free_slots.append(table_idx)", "# BUG: leak"),)),
    )
    base = fast.TableManager.__dict__["free"]
    with patched("sub-leak"):
        assert "# BUG: leak" in inspect.getsource(Sub.__dict__["free"])
        assert fast.TableManager.__dict__["free"] is base
    assert "free" not in Sub.__dict__ and fast.TableManager.__dict__["free"] is base


def test_patches_inside_patched_derive_from_the_live_method():
    name = "lock-keeps-heap-entry"
    outside = inspect.getsource(BUGS[name].patches()[0][2])
    with patched(name):
        assert inspect.getsource(BUGS[name].patches()[0][2]) == outside


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
            _ = 1 / 0
    assert _current(BUGS[name].patches()) == before


def test_patched_none_and_unknown():
    with patched(None):
        pass
    with pytest.raises(KeyError, match="unknown bug"):
        with patched("no-such-bug"):
            pass


def test_zoo_table_reports_counts_and_marks_escapes():
    """The table reports the sequence or case that caught a bug, never seconds; a bug missed by
    runs cut short by a seconds cap is undecided, not escaped."""
    rows = [
        ZooRow("a", "x", hyp_caught=True, hyp_sequences=12, hyp_seconds=1.25, fuzz_caught=False, fuzz_cases=100),
        ZooRow("b", "y", hyp_caught=False, hyp_sequences=150, fuzz_caught=None),
        ZooRow("c", "z", hyp_caught=False, hyp_capped=True, fuzz_caught=False, fuzz_cases=100),
    ]
    table = format_table(rows)
    assert "hypothesis" in table.splitlines()[2] and "# 12" in table and "missed 100" in table
    assert "1.2" not in table
    assert "ESCAPED" in table.splitlines()[3] and "UNDECIDED" in table.splitlines()[4]
    assert [r.escaped for r in rows] == [False, True, False]
    assert [r.undecided for r in rows] == [False, False, True]


def test_replay_cli_with_a_bug(capsys):
    """`kvledger replay TRACE --bug NAME` diverges (exit 1) where the plain replay agrees (exit 0);
    an unknown bug is a clear error (exit 2)."""
    from kvledger.checker.replay import replay_file

    trace = str(TRACES / "allocate-floor-pages.jsonl")
    assert replay_file(trace) == 0
    assert replay_file(trace, bug="allocate-floor-pages") == 1
    assert "DIVERGED" in capsys.readouterr().out
    assert replay_file(trace, bug="no-such-bug") == 2
    assert "unknown bug" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["touch-keeps-heap-entry", "insert-keeps-parent-heap-entry"])
def test_the_ci_profile_catches_the_heap_bookkeeping_bugs(name):
    """The derandomized CI property run, with the bug patched in and no shrinking, fails before its
    last sequence (it stops at the first failure). A fresh interpreter, as for the rare events:
    which sequences a derandomized run generates is decided by counts and its seed alone."""
    import re
    import subprocess
    import sys

    root = ROOT
    run = subprocess.run(
        [sys.executable, "-m", "kvledger.checker.check", "--seeds", "ci", "--bug", name],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    caught = re.search(rf"seed ci: {name} caught at sequence (\d+)", run.stdout)
    assert caught, f"the CI profile missed {name}: {run.stdout[-2000:]}"


def test_the_zoo_decides_by_sequences_not_seconds(tmp_path):
    """The CI profile's catch is the number of the sequence that failed first: a budget of that many
    sequences catches the bug, one fewer misses it, however long either run took."""
    from kvledger.checker.audit.zoo_run import run_hypothesis

    caught = run_hypothesis("table-slot-leak", tmp_path / "all", sequences=150)
    assert caught["caught"] and not caught["timed_out"], caught
    first = caught["sequence"]
    assert 1 <= first <= 150
    assert run_hypothesis("table-slot-leak", tmp_path / "same", sequences=first)["sequence"] == first
    if first > 1:
        missed = run_hypothesis("table-slot-leak", tmp_path / "fewer", sequences=first - 1)
        assert not missed["caught"] and missed["sequences"] == first - 1, missed
