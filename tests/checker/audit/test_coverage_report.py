"""`kvledger coverage`: the property run under coverage.py reports line and branch coverage of fast/
and the scheduler-side cache logic, set against the reviewed list of lines it cannot reach. (That
the list is exactly true for the ci profile is tests/properties/test_lockstep_machine.py's business.)"""

import pytest

from kvledger.checker.audit.coverage_report import (
    EXCLUSIONS,
    Exclusion,
    against_exclusions,
    format_files,
    format_totals,
    measure,
    read_exclusions,
)


def test_coverage_of_the_cache_logic_by_a_short_property_run():
    report = measure(examples=3)
    totals = report["totals"]
    assert totals["num_statements"] > 500 and totals["num_branches"] > 100
    assert 0 < totals["covered_lines"] <= totals["num_statements"]
    assert {
        "fast/cache_manager.py",
        "fast/radix_cache.py",
        "engine/ledger/cache_scheduler.py",
        "engine/ledger/divergence.py",
    } <= set(report["files"])
    assert all(
        name.startswith("fast/") or name in ("engine/ledger/cache_scheduler.py", "engine/ledger/divergence.py")
        for name in report["files"]
    )
    assert "engine/ledger/cache_scheduler.py" in report["_table"]
    assert "branch coverage" in format_totals(report)
    assert "engine/ledger/cache_scheduler.py" in format_files(against_exclusions(report, read_exclusions()))


def test_every_exclusion_has_a_reason_and_names_a_measured_file():
    entries = read_exclusions()
    assert entries and all(e.reason for e in entries)
    assert {e.path for e in entries} <= {"engine/ledger/cache_scheduler.py", "engine/ledger/divergence.py"} | {
        f"fast/{p.name}" for p in (EXCLUSIONS.parents[1] / "fast").glob("*.py")
    }


def test_exclusion_syntax(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("# comment\n\na.py:3  why\na.py:5-7  a range\na.py:9->-2  an exit\na.py:9->12  a branch\n")
    assert read_exclusions(path) == [
        Exclusion("a.py", 3, "why"),
        *(Exclusion("a.py", n, "a range") for n in (5, 6, 7)),
        Exclusion("a.py", 9, "an exit", -2),
        Exclusion("a.py", 9, "a branch", 12),
    ]
    for bad in ("a.py:3", "a.py  no line", "a.py:x  why", "a.py:7-5  backwards", "a.py:3-4->5  both"):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match="expected"):
            read_exclusions(path)


def test_uncovered_lines_and_branches_are_set_against_the_list():
    report = {
        "files": {
            "a.py": {
                "summary": {"covered_lines": 6, "num_statements": 9, "covered_branches": 2, "num_branches": 6},
                "missing_lines": [3, 4, 8],
                "missing_branches": [[2, 3], [2, 4], [7, 8], [10, -1]],
            }
        }
    }
    listed = [
        Exclusion("a.py", 3, "r"),
        Exclusion("a.py", 5, "covered"),
        Exclusion("a.py", 10, "r", -1),
        Exclusion("a.py", 11, "r", 12),
        Exclusion("b.py", 1, "no such file"),
    ]
    a, b = against_exclusions(report, listed)
    assert (a.listed, a.unlisted, a.stale) == ([3], [4, 8], ["5", "11->12"])
    # 2->3 lands on a listed line, 10->-1 is listed itself
    assert a.unlisted_branches == [(2, 4), (7, 8)]
    assert a.accounted == (100.0 * 7 / 9, 100.0 * 4 / 6)
    assert (b.path, b.stale) == ("b.py", ["1"])
    assert "stale exclusions" in format_files([a, b])
