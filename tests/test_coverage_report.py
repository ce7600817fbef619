"""`kvledger coverage`: the property run under coverage.py reports fast/'s line and branch coverage."""

from kvledger.tools.coverage_report import format_totals, measure


def test_coverage_of_fast_by_a_short_property_run():
    report = measure(examples=3)
    totals = report["totals"]
    assert totals["num_statements"] > 300 and totals["num_branches"] > 50
    assert 0 < totals["covered_lines"] <= totals["num_statements"]
    assert all(name.startswith("fast") for name in report["files"])
    assert "fast/cache_manager.py" in report["_table"]
    assert "branch coverage" in format_totals(report)
