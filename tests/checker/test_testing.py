"""A maintainer's test of their own cache manager: `check_subject` and the `kvledger_check`
fixture pass the toy block cache and fail its planted leak with the minimized trace. Counts decide
(a few sequences of the derandomized CI profile, a seeded fuzz), never time."""

from __future__ import annotations

import json

import pytest

from kvledger.checker import SubjectFinding, check_subject
from tests.support import toy_block_subject

pytest_plugins = ["pytester"]


def test_a_correct_subject_passes_the_ci_profile_and_a_seeded_fuzz(tmp_path):
    report = check_subject(toy_block_subject.factory, examples=10, fuzz_cases=10, out_dir=tmp_path)
    assert "passed" in report and "no finding" in report
    assert not list(tmp_path.rglob("*.jsonl"))


def test_a_planted_leak_fails_with_the_minimized_trace(tmp_path):
    with pytest.raises(SubjectFinding) as caught:
        check_subject("tests.support.toy_block_subject:leaky", examples=10, out_dir=tmp_path)
    finding = caught.value
    assert finding.kind == "1-2-partition"
    assert 1 <= len(finding.ops) <= 6
    assert [json.loads(op)["op"] for op in finding.ops][0] == "submit"
    assert finding.trace_path.exists() and finding.trace_path.parent == tmp_path
    assert f"kvledger replay {finding.trace_path}" in str(finding)
    assert "[1-2-partition]" in str(finding) and finding.ops[0] in str(finding)


def skips_ref(config):
    return toy_block_subject.ToyBlockCache(config, bug="hit-skips-ref")


def test_a_seeded_fuzz_finds_what_the_profile_was_not_asked_to(tmp_path):
    with pytest.raises(SubjectFinding) as caught:
        check_subject(skips_ref, examples=0, fuzz_cases=5, seed=0, out_dir=tmp_path, minimize_budget=4.0)
    finding = caught.value
    assert finding.kind == "1-2-partition" and 1 <= len(finding.ops) <= 6
    assert finding.trace_path.parent == tmp_path / "fuzz" and finding.trace_path.name.endswith(".min.jsonl")
    assert finding.replay == f"kvledger replay {finding.trace_path}"


def test_the_fixture_fails_a_maintainers_test_with_the_trace(pytester):
    pytester.makeconftest('pytest_plugins = ["kvledger.checker.pytest_plugin"]')  # as the docs say
    pytester.makepyfile(
        """
        from tests.support import toy_block_subject

        def test_clean(kvledger_check):
            kvledger_check(toy_block_subject.factory, examples=5)

        def test_leaky(kvledger_check):
            kvledger_check(toy_block_subject.leaky, examples=10)
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*SubjectFinding*[1-2-partition]*", "*minimized trace, * operations:*"])
    result.stdout.fnmatch_lines(["*kvledger replay *leaky-1-2-partition.jsonl*"])


def test_the_plugin_loads_without_the_checker():
    import subprocess
    import sys

    heavy = "('hypothesis', 'numpy', 'torch', 'kvledger.properties.subject')"
    code = f"import sys, kvledger.checker.pytest_plugin; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
