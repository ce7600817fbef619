"""Engine options are checked at start-up: every bad one raises EngineOptionError naming it before
anything loads (LLM), or exits with status 2 and one line naming its flag (kvledger generate)."""

import argparse
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import kvledger.engine.runtime.build
from kvledger.cli import main
from kvledger.engine.engine_config import EngineConfig
from kvledger.engine.options import EngineOptionError
from kvledger.engine.runtime.llm import LLM
from kvledger.fast import SamplingParams
from tests.support.models import tiny_config
from tests.support.paths import ROOT as REPO

ROOT = str(REPO)
TINY = tiny_config(
    arch="llama", vocab_size=128, hidden_size=32, intermediate_size=64, head_dim=8, max_position_embeddings=256
)

BAD = [
    ("model", "/no/such/model.gguf"),
    ("model", __file__),
    ("model", 3),
    ("model", TINY),
    ("dtype", "float64"),
    ("dtype", None),
    ("device", "tpu"),
    ("device", "cuda:x"),
    ("device", 0.5),
    ("page_size", 0),
    ("page_size", -16),
    ("page_size", True),
    ("page_size", 16.0),
    ("page_size", "16"),
    ("cache_type", "lru"),
    ("kv_cache_tokens", 0),
    ("kv_cache_tokens", -4096),
    ("kv_cache_tokens", 15),
    ("kv_cache_tokens", 4096.0),
    ("max_running_req", 0),
    ("max_running_req", False),
    ("max_running_req", 1.5),
    ("max_seq_len", 0),
    ("max_seq_len", 1),
    ("max_seq_len", 512.0),
    ("max_prefill_tokens", 0),
    ("max_prefill_tokens", -1),
    ("max_prefill_tokens", None),
    ("seed", -1),
    ("seed", 2**32),
    ("seed", 1.5),
    ("seed", None),
    ("seed", True),
    ("threads", 0),
    ("threads", 2.0),
    ("attention", "flash"),
    ("fp8_decode_kernel", "cutlass"),
    ("fp8_decode_kernel", None),
    ("cuda_graphs", "yes"),
    ("overlap", 1),
    ("verify", None),
    ("dummy_weights", 0),
    ("trace", "/no/such/dir/trace.jsonl"),
    ("trace", ROOT),
    ("trace", 7),
]


@pytest.fixture
def no_loading(monkeypatch):
    def load_weights(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(kvledger.engine.runtime.build, "load_weights", load_weights)


@pytest.mark.parametrize("option,value", BAD, ids=[f"{o}={v!r}"[:40] for o, v in BAD])
def test_a_bad_option_is_named_before_loading(no_loading, option, value):
    with pytest.raises(EngineOptionError) as e:
        LLM(**{option: value})
    assert e.value.option == option and str(e.value).startswith(f"{option} ")
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


def test_messages_say_what_is_wrong(no_loading):
    with pytest.raises(EngineOptionError, match="^page_size must be at least 1, got 0$"):
        LLM(page_size=0)
    with pytest.raises(EngineOptionError, match=r"^kv_cache_tokens must be at least one page \(16 tokens\), got 8$"):
        LLM(kv_cache_tokens=8)
    with pytest.raises(EngineOptionError, match="^page_size must be an integer, got True$"):
        LLM(page_size=True)


def test_cuda_without_cuda_is_a_clear_error(no_loading, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EngineOptionError, match="^device is 'cuda', but CUDA is not available"):
        LLM(device="cuda")


def test_max_seq_len_above_the_models_positions():
    with pytest.raises(EngineOptionError, match=r"^max_seq_len must be at most .*\(256\), got 257$"):
        LLM(TINY, dummy_weights=True, max_seq_len=257)
    assert LLM(TINY, dummy_weights=True, max_seq_len=256).engine.config.max_seq_len == 256


def test_kv_cache_tokens_are_rounded_down_to_whole_pages():
    assert LLM(TINY, dummy_weights=True, page_size=4, kv_cache_tokens=10).engine.config.num_pages == 2


def test_a_one_token_prefill_budget_runs_prompts_longer_than_it():
    prompts = [list(range(3, 40)), list(range(3, 30)), list(range(50, 61))]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = {}
    for budget in (1, 2048):
        llm = LLM(
            TINY,
            dummy_weights=True,
            page_size=4,
            kv_cache_tokens=512,
            max_seq_len=128,
            max_prefill_tokens=budget,
            verify=True,
        )
        outs[budget] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.engine.check_idle()
    assert outs[1] == outs[2048] and all(len(t) == 6 for t in outs[1])


def test_every_engine_option_is_a_cli_flag_with_help_and_its_default():
    parser = argparse.ArgumentParser()
    EngineConfig.add_arguments(parser)
    by_dest = {}
    for action in parser._actions:
        if action.dest != "help":
            by_dest.setdefault(action.dest, []).append(action)
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    assert sorted(by_dest) == sorted(names)
    assert all(a.help for actions in by_dest.values() for a in actions)
    defaults = vars(parser.parse_args([]))
    assert EngineConfig.from_args(argparse.Namespace(**defaults)) == EngineConfig()
    assert EngineConfig.flag("cache_type") == "--cache" and EngineConfig.flag("page_size") == "--page-size"


def test_the_former_name_max_running_reqs_still_works_with_a_warning():
    parser = argparse.ArgumentParser()
    EngineConfig.add_arguments(parser)
    with pytest.warns(FutureWarning, match="--max-running-reqs is deprecated: use --max-running-req"):
        args = parser.parse_args(["--max-running-reqs", "7"])
    assert EngineConfig.from_args(args).max_running_req == 7
    assert parser.parse_args([]).max_running_req == 64
    with pytest.warns(FutureWarning, match="max_running_reqs is deprecated: use max_running_req"):
        assert EngineConfig.create(max_running_reqs=5).max_running_req == 5


def test_an_unknown_option_is_named():
    with pytest.raises(EngineOptionError, match="pages_size is not an engine option"):
        LLM(pages_size=16)


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--max-running-req", "0"),
        ("--max-prefill-tokens", "0"),
        ("--kv-cache-tokens", "0"),
        ("--max-seq-len", "0"),
        ("--threads", "0"),
    ],
)
def test_generate_names_the_flag(capsys, flag, value):
    assert main(["generate", flag, value, "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvledger generate: {flag} must be at least") and err.count("\n") == 1


def test_generate_page_size_0_exits_2_with_one_line():
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    r = subprocess.run(
        [sys.executable, "-m", "kvledger", "generate", "--page-size", "0", "hi"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "kvledger generate: --page-size must be at least 1, got 0\n"
