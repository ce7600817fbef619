"""`kvledger bench --workload early-stop`: the workload, the options, and a tiny run on the CPU
(random SmolLM2-135M weights) checked by counts, never by timings."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvledger.bench.admission import EarlyStopOptions, default_kv_cache_tokens, worst_case_tokens
from kvledger.bench.workloads import early_stop as make_early_stop_workload
from kvledger.cli import build_parser, main
from kvledger.cli.bench import early_stop_options as options_from_args


def test_workload_is_seeded_and_clamped():
    a = make_early_stop_workload(64, 200, 300, output_median=40, seed=3)
    assert a.prompts == make_early_stop_workload(64, 200, 300, output_median=40, seed=3).prompts
    assert a.output_lens == make_early_stop_workload(64, 200, 300, output_median=40, seed=3).output_lens
    assert make_early_stop_workload(64, 200, 300, output_median=40, seed=4).output_lens != a.output_lens
    assert all(20 <= len(p) <= 200 for p in a.prompts)  # nano-vllm's bounds, scaled: 100/1024 of the longest
    assert all(1 <= n <= 300 for n in a.output_lens)
    capped = make_early_stop_workload(64, 200, 30, output_median=40, seed=3)
    assert max(capped.output_lens) == 30 and capped.describe()["requests_at_max_tokens"] > 0
    d = a.describe()
    assert d["output_tokens"] == sum(a.output_lens) and d["output_len_max"] == max(a.output_lens)
    assert 20 <= d["output_len_median"] <= 80 and d["output_len_p90"] > d["output_len_median"]  # lognormal, median 40
    with pytest.raises(ValueError):
        make_early_stop_workload(0, 200, 300, output_median=40)


def test_default_pool_holds_an_eighth_of_the_worst_cases():
    w = make_early_stop_workload(256, 1024, 2048, output_median=200)
    assert worst_case_tokens(w, 16) == 3072  # longest prompt 1024 + 2048
    assert default_kv_cache_tokens(w, 256, 16) == 32 * 3072
    assert default_kv_cache_tokens(w, 64, 16) == 8 * 3072
    small = make_early_stop_workload(3, 16, 8, output_median=2)
    assert default_kv_cache_tokens(small, 256, 16) == worst_case_tokens(small, 16)  # at least one


def test_shared_options_count_only_when_given():
    parser = build_parser()
    args = parser.parse_args(["bench", "--workload", "early-stop"])
    assert (args.num_requests, args.max_input_len, args.model_config) == (256, 1024, "qwen3-0.6b")  # nano's
    opts = options_from_args(args)
    assert (opts.num_requests, opts.max_input_len, opts.model_config, opts.max_tokens) == (None, None, None, None)
    cpu = EarlyStopOptions(**{**vars(opts), "device": "cpu"}).resolve()
    assert (cpu.num_requests, cpu.max_input_len, cpu.max_tokens, cpu.output_median) == (24, 128, 256, 25.0)
    assert cpu.model_config is None and cpu.dtype == "float32" and cpu.cuda_graphs is False  # the embedded model
    args = parser.parse_args(
        [
            "bench",
            "--workload",
            "early-stop",
            "--num-requests",
            "256",
            "--model-config",
            "smollm2-135m",
            "--max-tokens",
            "64",
            "--policies",
            "optimistic",
            "--ratios",
            "0.3",
        ]
    )
    opts = EarlyStopOptions(**{**vars(options_from_args(args)), "device": "cpu"}).resolve()
    assert (opts.num_requests, opts.model_config, opts.max_tokens) == (256, "smollm2-135m", 64)
    assert opts.output_median == 6.25  # 200/2048 of max_tokens
    assert opts.run_list() == [("reserve", None), ("optimistic", 0.3)]
    if torch.cuda.is_available():  # pragma: no cover - GPU machines
        gpu = EarlyStopOptions(device="cuda").resolve()
        assert (gpu.num_requests, gpu.max_tokens, gpu.model_config, gpu.dtype) == (256, 2048, "qwen3-0.6b", "bfloat16")


@pytest.mark.parametrize("flags", [["--ratios", "0.5,x"], ["--ratios", "1.5"], ["--policies", "reserve,eager"]])
def test_bad_runs_are_usage_errors(flags, capsys):
    assert main(["bench", "--workload", "early-stop", "--device", "cpu", *flags]) == 2
    assert capsys.readouterr().err.startswith("kvledger bench --workload early-stop: ")


def test_tiny_run_on_the_cpu(tmp_path, capsys):
    out_json = tmp_path / "early.json"
    torch.set_num_threads(1)  # xdist runs one worker per core
    # page size 4: the pool (one worst case, 24 tokens) never holds two requests' worst cases
    rc = main(
        [
            "bench",
            "--workload",
            "early-stop",
            "--device",
            "cpu",
            "--model-config",
            "smollm2-135m",
            "--num-requests",
            "6",
            "--max-input-len",
            "16",
            "--max-tokens",
            "8",
            "--output-median",
            "3",
            "--ratios",
            "0",
            "--page-size",
            "4",
            "-o",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    w = make_early_stop_workload(6, 16, 8, output_median=3)
    early = sum(n < 8 for n in w.output_lens)
    assert len(set(w.output_lens)) > 2 and 0 < early < 6  # most end early, each at its own length; one by length
    total = sum(w.output_lens)
    assert re.search(
        r"^policy\s+output tokens\s+time \(s\)\s+tok/s\s+mean batch\s+peak batch\s+decode steps\s+"
        r"preemptions\s+recomputed\s+recomp/out\s+vs reserve$",
        out,
        re.M,
    ), out
    for label in ("reserve", "optimistic 0"):
        assert re.search(rf"^{label}\s+{total}\s", out, re.M), (label, out)
        assert (
            f"token counts {label}: OK ({total} of {total}; {early} stopped early by the bench, {6 - early} by "
            f"max_tokens" in out
        ), out

    report = json.loads(out_json.read_text())
    for key in (
        "workload",
        "options",
        "model",
        "dtype",
        "device",
        "device_name",
        "versions",
        "engine_kwargs",
        "kv_pool",
        "runs",
        "ok",
    ):
        assert key in report, key
    assert report["ok"] and report["device"] == "cpu" and report["dtype"] == "float32"
    assert report["workload"]["output_lens"] == w.output_lens and report["workload"]["max_tokens"] == 8
    assert report["kv_pool"]["tokens"] == worst_case_tokens(w, 4) == report["engine_kwargs"]["kv_cache_tokens"] == 24
    reserve, optimistic = report["runs"]
    assert [(r["policy"], r["reserve_ratio"]) for r in report["runs"]] == [("reserve", None), ("optimistic", 0.0)]
    for r in report["runs"]:
        for key in (
            "output_tokens",
            "seconds",
            "tok_per_s",
            "mean_batch",
            "peak_batch",
            "decode_steps",
            "preemptions",
            "recomputed_tokens",
            "recomputed_fraction",
            "speedup_vs_reserve",
        ):
            assert key in r, key
        # every request delivered exactly its drawn length, no more, no fewer
        assert r["token_counts_ok"] and r["mismatched_requests"] == 0 and not r["errors"]
        assert r["output_tokens"] == r["expected_output_tokens"] == total
        assert (r["stopped_early"], r["finished_by_length"]) == (early, 6 - early)
    assert reserve["preemptions"] == 0 and reserve["recomputed_tokens"] == 0 and reserve["peak_batch"] == 1
    assert optimistic["mean_batch"] > reserve["mean_batch"] and optimistic["peak_batch"] > 1
    assert optimistic["preemptions"] > 0  # reserving none of the output: the pool runs short, victims resume
