"""`kvledger bench host`: the engine's host cost per step with the model stubbed out (CPU)."""

from __future__ import annotations

import re

import pytest

from kvledger.bench.host import measure
from kvledger.cli import main
from kvledger.engine.runtime.requests import RequestRecord
from kvledger.fast import SamplingParams


def test_the_stubbed_engine_delivers_every_token_and_counts_its_steps():
    cost, report = measure(num_requests=12, seed=3, profile=True)
    assert cost.tokens == cost.expected_tokens > 0
    # one decode step per token of the longest request at least, plus the prefill steps
    assert cost.steps > max(cost.expected_tokens // 12, 1)
    assert set(cost.host_ms) == {"schedule", "complete", "land", "wait"}
    assert all(v >= 0 for v in cost.host_ms.values()) and cost.host_ms["schedule"] > 0
    assert "engine.py" in report and "ncalls" in report  # cProfile's table


def test_cli_prints_the_figures_and_refuses_a_bad_device(capsys):
    assert main(["bench", "host", "--num-requests", "6", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"[\d,]+ steps in [\d.]+ s: [\d.]+ ms per step; host ms per step: schedule [\d.]+", out)
    assert "token counts: OK" in out
    assert main(["bench", "host", "--device", "tpu"]) == 2
    assert "--device must be cpu or cuda, got 'tpu'" in capsys.readouterr().err


def test_a_request_stops_on_eos_unless_it_ignores_eos():
    eos = frozenset({2, 5})
    assert RequestRecord.of(1, SamplingParams(stop_token_ids=[7]), eos).stop_ids == {2, 5, 7}
    assert RequestRecord.of(1, SamplingParams(stop_token_ids=[7], ignore_eos=True), eos).stop_ids == {7}
    assert RequestRecord.of(1, SamplingParams(ignore_eos=True), eos).stop_ids == frozenset()


@pytest.mark.cuda
def test_on_cuda_the_tiny_model_runs_in_graphs_after_its_warm_up():
    cost, _ = measure(num_requests=8, seed=1, device="cuda")
    assert cost.device == "cuda" and cost.tokens == cost.expected_tokens > 0
