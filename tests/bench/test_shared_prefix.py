"""`kvledger bench --workload shared-prefix`: the workload's shape, and a CPU smoke run where the
radix cache finds the groups' prefixes and the naive one does not."""

from __future__ import annotations

import json

import pytest
import torch

from kvledger.bench.workloads import shared_prefix as make_workload
from kvledger.cli import main


def test_every_request_starts_with_its_groups_prefix_and_the_order_is_seeded():
    w = make_workload(groups=4, group_size=5, prefix_len=30, question_len=7, answer_len=3, vocab=50_000, seed=1)
    assert len(w.prompts) == 20 and all(len(p) == 37 for p in w.prompts)
    assert w.output_tokens == 60 and w.input_tokens == 20 * 37 and w.describe()["prompt_tokens"] == 20 * 37
    prefixes = {}
    for g, p in zip(w.group_of, w.prompts):
        prefixes.setdefault(g, set()).add(tuple(p[:30]))
        assert max(p) < 10_000  # nano-vllm's token id range
    assert all(len(s) == 1 for s in prefixes.values()) and len({next(iter(s)) for s in prefixes.values()}) == 4
    assert w.group_of != sorted(w.group_of)  # shuffled: a group's requests arrive spread out
    again = make_workload(4, 5, 30, 7, 3, 50_000, seed=1)
    assert again.prompts == w.prompts and make_workload(4, 5, 30, 7, 3, 50_000, seed=2).prompts != w.prompts


@pytest.mark.parametrize(
    "field,value", [("groups", 0), ("group_size", 0), ("question_len", 0), ("answer_len", 0), ("prefix_len", -1)]
)
def test_a_bad_shape_is_refused_naming_it(field, value):
    kw = dict(groups=2, group_size=2, prefix_len=8, question_len=4, answer_len=2, vocab=100)
    kw[field] = value
    with pytest.raises(ValueError, match=field):
        make_workload(**kw)


def test_radix_finds_the_shared_prefixes_and_naive_computes_every_prompt_token(tmp_path, capsys):
    out = tmp_path / "sp.json"
    rc = main(
        [
            "bench",
            "--workload",
            "shared-prefix",
            "--model-config",
            "smollm2-135m",
            "--device",
            "cpu",
            "--groups",
            "3",
            "--group-size",
            "4",
            "--prefix-len",
            "64",
            "--question-len",
            "8",
            "--answer-len",
            "3",
            "--page-size",
            "4",
            "--max-prefill-tokens",
            "80",
            "--threads",
            "1",
            "--caches",
            "radix,radix-flat,naive",
            "--profile-requests",
            "4",
            "--profile-output-len",
            "2",
            "-o",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    report = json.loads(out.read_text())
    radix, flat, naive = report["runs"]
    assert (radix["cache"], flat["cache"], naive["cache"]) == ("radix", "radix-flat", "naive") and report["ok"]
    # the same cache without cascade decode: the same admissions, so the same hits
    assert flat["cached_tokens"] == radix["cached_tokens"] and flat["steps"] == radix["steps"]
    assert naive["cached_tokens"] == 0 and naive["prefill_tokens_computed"] == 12 * 72
    # every request after its group's first can reuse the 64-token prefix (whole pages)
    assert 0 < radix["cached_tokens"] <= 9 * 64 and radix["cached_tokens"] % 4 == 0
    assert radix["prefill_tokens_computed"] == 12 * 72 - radix["cached_tokens"]
    assert "radix over naive:" in text and "cascade decode attention:" in text
    assert sorted(report["decode_profiles"]) == ["naive", "radix", "radix-flat"]
    assert all(p["requests"] == 4 and p["decode_steps"] >= 1 for p in report["decode_profiles"].values())
    assert text.count("decode profile (kvledger): 4 requests") == 3
    # the host's share of each run, per step: the part of a step the GPU cannot hide
    for r in (radix, flat, naive):
        assert set(r["host_seconds"]) == {"schedule", "complete", "land", "wait"}
        assert 0 < r["host_seconds"]["schedule"] < r["seconds"]
        steps = r["steps"]["prefill"] + r["steps"]["decode"]
        assert f"{r['cache']} steps: {r['steps']['prefill']:,} prefill + {r['steps']['decode']:,} decode" in text
        assert steps > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_the_kernel_sweeps_refuse_without_a_gpu_and_name_a_bad_sweep(capsys):
    from kvledger.bench.decode_kernels import main as sweeps

    assert sweeps([]) == 2
    assert capsys.readouterr().err.strip() == "python -m kvledger.bench.decode_kernels: needs a CUDA device"
    with pytest.raises(SystemExit) as e:
        sweeps(["plain", "prefil"])
    assert e.value.code == 2 and "unknown sweep 'prefil'" in capsys.readouterr().err
