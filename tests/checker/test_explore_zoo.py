"""Exploration finds each of the zoo's 39 bugs, with the shortest counterexample recorded in
`explore_scope.BUG_SCOPES` (and docs/bug-zoo.md): each search is cut at that depth."""

from __future__ import annotations

import pytest

from kvledger.checker.explore import explore
from kvledger.checker.explore_scope import BUG_SCOPES, scope_for_bug
from kvledger.subjects.fast_zoo import BUGS


def test_every_bug_has_a_scope() -> None:
    assert set(BUG_SCOPES) == set(BUGS)


@pytest.mark.parametrize("bug", list(BUGS))
def test_exploration_finds_bug_with_its_shortest_trace(bug: str) -> None:
    where = BUG_SCOPES[bug]
    result = explore(scope_for_bug(bug), bug=bug, progress=False)
    assert result.findings, f"{bug}: nothing found in {where.scope} up to depth {where.max_depth}"
    finding = result.findings[0]
    assert (finding.kind, finding.depth, len(finding.ops)) == (where.kind, where.max_depth, where.max_depth)
