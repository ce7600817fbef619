"""`kvledger explore`: the CI scope exhausts clean, counterexamples replay, canonical keys merge only
states that observe alike (docs/exploration.md). Every test decides by counts, never by time."""

from __future__ import annotations

import pytest

from kvledger.checker.explore import audit_merges, explore, format_result
from kvledger.checker.explore_scope import OP_KINDS, SCOPES, Scope
from kvledger.cli import main
from kvledger.engine.ledger import trace

# branching prompts (two leaves: LRU order matters), probes and evictions; small enough to audit
AUDIT = Scope(
    "audit",
    num_pages=3,
    page_size=1,
    table_slots=2,
    prompts=((0,), (1,), (0, 0)),
    max_tokens=(1,),
    budgets=(8,),
    ops=frozenset(OP_KINDS) - {"idle"},
    max_depth=4,
)


def test_ci_scope_is_exhausted_with_no_divergence() -> None:
    result = explore(SCOPES["ci"], progress=False)
    assert result.exhausted and result.cut is None
    assert result.findings == []
    assert result.states > 4000 and result.transitions > 20000 and result.depth >= 10
    assert result.keys == result.states
    assert sum(result.per_depth) == result.states


def test_search_is_deterministic_and_cut_by_depth() -> None:
    scope = SCOPES["ci"].with_(max_depth=4)
    a, b = explore(scope, progress=False), explore(scope, progress=False)
    assert (a.states, a.transitions, a.per_depth) == (b.states, b.transitions, b.per_depth)
    assert not a.exhausted and a.cut == "depth" and a.depth == 4
    assert "cut (depth)" in format_result(a)


def test_counterexample_replays_and_shows(tmp_path, capsys) -> None:
    bug = "lru-evicts-mru"
    result = explore(SCOPES["bug-radix"].with_(max_depth=6), bug=bug, out_dir=tmp_path, progress=False)
    assert [f.kind for f in result.findings] == ["result:evict"]
    finding = result.findings[0]
    assert finding.depth == len(finding.ops) == 4
    header, ops = trace.read(finding.trace_path)
    assert header.producer == "kvledger explore" and ops == finding.ops
    capsys.readouterr()
    assert main(["replay", str(finding.trace_path), "--bug", bug]) == 1
    assert "result:evict" in capsys.readouterr().out
    assert main(["replay", str(finding.trace_path)]) == 0  # clean without the bug
    pytest.importorskip("matplotlib")
    png = tmp_path / "trace.png"
    assert main(["show", str(finding.trace_path), "-o", str(png), "--bug", bug]) in (0, 1)
    assert png.exists()


def test_copy_and_replay_paths_agree() -> None:
    scope = SCOPES["small"].with_(max_depth=5)
    copied, replayed = explore(scope, path="copy", progress=False), explore(scope, path="replay", progress=False)
    assert (copied.states, copied.transitions) == (replayed.states, replayed.transitions)
    assert copied.per_depth == replayed.per_depth


@pytest.mark.parametrize("bug", [None, "lru-evicts-mru", "free-list-lifo"])
def test_canonical_finds_what_plain_and_tree_search_find(bug) -> None:
    """Same divergence kinds at the same shortest depth with canonical keys, exact keys and no
    merging at all; canonical stores the fewest states."""
    scope = SCOPES["bug-radix"].with_(name="tiny", prompts=((0,), (1, 0)), max_tokens=(1,), budgets=(8,), max_depth=4)
    runs = {
        (canonical, merge): explore(scope, bug=bug, canonical=canonical, merge=merge, all_kinds=True, progress=False)
        for canonical, merge in ((True, True), (False, True), (False, False))
    }
    canonical, plain, tree = runs[(True, True)], runs[(False, True)], runs[(False, False)]
    assert canonical.kinds == plain.kinds == tree.kinds
    assert (bug is None) == (canonical.kinds == {})
    assert canonical.states < plain.states < tree.states


def test_merged_states_observe_alike() -> None:
    """Each merged pair observes alike for two more operations (results and divergences renamed).
    Dropping the LRU clock from the key makes this fail (4 of 80 pairs; docs/exploration.md)."""
    audit = audit_merges(AUDIT, lookahead=2, max_merges=80)
    assert audit.merges == 80
    assert audit.mismatches == []


def test_ctrl_c_reports_what_was_explored(monkeypatch) -> None:
    from kvledger.checker import explore as mod

    calls = {"n": 0}
    real = mod.LockstepBackend.key

    def interrupted(self, lock):
        calls["n"] += 1
        if calls["n"] == 30:
            raise KeyboardInterrupt
        return real(self, lock)

    monkeypatch.setattr(mod.LockstepBackend, "key", interrupted)
    result = explore(SCOPES["ci"], progress=False)
    assert result.cut == "interrupted" and not result.exhausted and 1 < result.states < 30


def test_cli_prints_scope_and_exit_codes(tmp_path, capsys) -> None:
    assert main(["explore", "--scope", "small", "--max-depth", "3", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "scope small" in out and "states " in out and "cut (depth)" in out and "peak RSS" in out
    code = main(["explore", "--scope", "small", "--bug", "free-list-lifo", "--out-dir", str(tmp_path)])
    assert code == 1 and "state:free_slots" in capsys.readouterr().out
    assert list(tmp_path.glob("*.jsonl"))
    assert main(["explore", "--scope", "nope"]) == 2
    assert main(["explore", "--scope", "small", "--bug", "nope"]) == 2


def test_subject_explores_by_replay_and_copy() -> None:
    scope = SCOPES["small"].with_(max_depth=4)
    replayed = explore(scope, subject="fast", path="replay", progress=False)
    copied = explore(scope, subject="fast", path="copy", progress=False)
    assert replayed.findings == [] and replayed.states > 20
    assert (copied.states, copied.transitions) == (replayed.states, replayed.transitions)
