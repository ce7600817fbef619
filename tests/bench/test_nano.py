"""`kvledger bench --workload nano-vllm`: the workload, the bandwidth floor, the profile summary, the CLI."""

from __future__ import annotations

import json
import random
import re
from types import SimpleNamespace

import pytest
import torch

from kvledger.bench.bandwidth_floor import decode_floor, kv_bytes_per_token, param_count, weight_bytes_per_step
from kvledger.bench.decode_profile import classify_kernel, summarize_profile
from kvledger.bench.hf import HF_CONTINUOUS as HF_ROW
from kvledger.bench.hf import make_cb_config
from kvledger.bench.runner import ENGINE_ROW, resolve_model_config
from kvledger.bench.workloads import nano_vllm as make_nano_workload
from kvledger.cli import build_parser, main
from kvledger.engine.model.config import ModelConfig
from kvledger.engine.model.weights import random_state_dict
from tests.support.models import tiny_config
from tests.support.paths import DATA

TINY = str(DATA / "nano_tiny_config.json")


def test_workload_is_nano_vllms_exactly():
    w = make_nano_workload()
    assert len(w.prompts) == len(w.max_tokens) == 256
    assert w.input_tokens == 142_827
    assert w.output_tokens == 133_966
    assert all(100 <= len(p) <= 1024 for p in w.prompts) and all(100 <= m <= 1024 for m in w.max_tokens)
    assert all(0 <= t <= 10000 for p in w.prompts for t in p)

    # nano-vllm's bench.py, verbatim in spirit: the module-level generator seeded with 0
    state = random.getstate()
    try:
        random.seed(0)
        prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
        max_tokens = [random.randint(100, 1024) for _ in range(256)]
    finally:
        random.setstate(state)
    assert w.prompts == prompts and w.max_tokens == max_tokens


def test_workload_scales_down():
    w = make_nano_workload(num_requests=3, max_input_len=16, max_output_len=4)
    assert len(w.prompts) == 3
    assert all(2 <= len(p) <= 16 for p in w.prompts) and all(1 <= m <= 4 for m in w.max_tokens)
    assert make_nano_workload(num_requests=3, max_input_len=16, max_output_len=4).prompts == w.prompts
    assert make_nano_workload(num_requests=3, max_input_len=16, max_output_len=4, seed=1).prompts != w.prompts
    with pytest.raises(ValueError):
        make_nano_workload(num_requests=0)


def _hand_config(tied: bool = True) -> ModelConfig:
    return tiny_config(
        arch="llama",
        vocab_size=10,
        hidden_size=4,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=4,
        tie_word_embeddings=tied,
        max_position_embeddings=64,
    )


def test_floor_on_a_hand_checked_case():
    c = _hand_config()
    # embedding 10*4 = 40, final norm 4; the layer: norms 2*4, qkv 3*4*4 = 48, o 16, gate+up 2*8*4 = 64, down 32
    assert param_count(c) == 40 + 4 + (8 + 48 + 16 + 64 + 32) == 212
    assert weight_bytes_per_step(c, 2) == 424
    assert kv_bytes_per_token(c, 2) == 2 * 1 * 1 * 4 * 2 == 16
    # request 0: prompt 3, 2 steps -> contexts 4, 5; request 1: prompt 5, 1 step -> context 6
    f = decode_floor(c, 2, [3, 5], [2, 1], bytes_per_s=1088.0)
    assert f["decode_steps"] == 2
    assert f["kv_tokens_read"] == 4 + 5 + 6
    assert f["total_bytes"] == 2 * 424 + 15 * 16 == 1088
    assert f["seconds"] == pytest.approx(1.0)
    assert f["tok_per_s"] == pytest.approx(3.0)

    # an untied input embedding is only gathered, so a step reads the LM head's 40 weights but not it
    untied = _hand_config(tied=False)
    assert param_count(untied) == 252 and weight_bytes_per_step(untied, 2) == 424


def test_param_count_matches_the_models():
    tiny, _, _ = resolve_model_config(TINY)
    assert param_count(tiny) == sum(t.numel() for t in random_state_dict(tiny).values())
    qwen, _, _ = resolve_model_config("qwen3-0.6b")
    assert param_count(qwen) == 596_049_920  # Qwen3-0.6B: 0.44B non-embedding + 151,936 x 1,024 tied
    assert kv_bytes_per_token(qwen, 2) == 114_688
    smol, _, _ = resolve_model_config("smollm2-135m")
    assert param_count(smol) == 134_515_008


@pytest.mark.parametrize(
    "name,kind",
    [
        ("_paged_attention_kernel", "attention"),
        ("_decode_attention_stage1_kernel", "attention"),
        ("_fwd_kernel", "attention"),
        ("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
        ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopB_TNN", "gemm"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>", "gemm"),
        ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn", "gemm"),
        ("void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false>", "gemm"),
        ("aten::mm", "gemm"),
        ("aten::addmm", "gemm"),
        (
            "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
            "unsigned int, long, 4> >"
            "(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4>)",
            "sampling",
        ),
        ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "sampling"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>", "sampling"),
        ("aten::argmax", "sampling"),
        ("_rms_norm_kernel", "other"),
        ("_fused_rope_kernel", "other"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "other"),
        ("Memcpy HtoD (Pinned -> Device)", "other"),
        ("aten::copy_", "other"),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all-reduce"),
        ("c10d::allreduce_", "all-reduce"),
        ("mkldnn::_linear_pointwise", "gemm"),
    ],
)
def test_classify_kernel(name, kind):
    assert classify_kernel(name) == kind


def _event(name, device, start, end, annotation=False, self_cpu=None):
    return SimpleNamespace(
        name=name,
        device_type=device,
        is_user_annotation=annotation,
        is_python_function=False,
        time_range=SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start),
        self_cpu_time_total=(end - start) if self_cpu is None else self_cpu,
    )


def test_summarize_profile_cuda_events():
    from torch.autograd import DeviceType

    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [
        _event("kvledger.schedule", cpu, 0, 300, annotation=True),
        _event("kvledger.wait", cpu, 250, 400, annotation=True),  # overlaps schedule: the union counts it once
        _event("kvledger.schedule", gpu, 0, 300, annotation=True),  # the GPU-side copy of an annotation: ignored
        _event("cudaLaunchKernel", cpu, 10, 20),  # host runtime call: not a kernel
        _event("_paged_attention_kernel", gpu, 100, 400),
        _event("nvjet_hsh_128x256_64x4_2x1_v_bz_coopB_TNN", gpu, 400, 800),
        _event("_rms_norm_kernel", gpu, 700, 900),  # overlaps the GEMM by 100 us (another stream)
        _event("void at::native::reduce_kernel<ArgMaxOps<float>>", gpu, 900, 1000),
    ]
    s = summarize_profile(events, decode_steps=2, wall_s=0.002, cuda=True)
    cats = s["categories"]
    assert cats["attention"]["ms_per_step"] == pytest.approx(0.15)
    assert cats["gemm"]["ms_per_step"] == pytest.approx(0.2)
    assert cats["other"]["ms_per_step"] == pytest.approx(0.1)
    assert cats["sampling"]["ms_per_step"] == pytest.approx(0.05)
    assert sum(c["percent"] for c in cats.values()) == pytest.approx(100.0)
    assert s["device_total_ms_per_step"] == pytest.approx(0.5)
    assert s["device_busy_ms_per_step"] == pytest.approx(0.45)  # union of [100, 1000]
    assert s["wall_ms_per_step"] == pytest.approx(1.0)
    assert s["host_ranges"]["kvledger.schedule"]["ms_per_step"] == pytest.approx(0.15)
    assert s["host_ranges"]["kvledger.wait"]["ms_per_step"] == pytest.approx(0.075)
    assert s["host_total_ms_per_step"] == pytest.approx(0.2)  # union of [0, 400]
    assert s["top_kernels"][0]["category"] == "gemm"


def test_cb_config_for_this_transformers():
    cb = make_cb_config(page_size=64, num_blocks=5, max_batch_tokens=128, no_such_field=1)
    assert getattr(cb, "page_size", getattr(cb, "block_size", None)) == 64
    assert cb.num_blocks == 5 and cb.max_batch_tokens == 128


def test_bench_parser_keeps_existing_defaults():
    args = build_parser().parse_args(["bench"])
    assert args.what == "engine" and args.workload is None and args.dtype is None and args.serve is None
    args = build_parser().parse_args(["bench", "--workload", "nano-vllm"])
    assert (args.num_requests, args.max_input_len, args.max_output_len) == (256, 1024, 1024)
    assert args.model_config == "qwen3-0.6b" and args.compare == "none" and args.cuda_graphs is None


def _check_table(out: str, rows: list[str], tokens: tuple[int, int], profiled: bool = True):
    assert re.search(
        r"^system\s+input tokens\s+output tokens\s+time \(s\)\s+throughput \(tok/s\)\s+ours/this$", out, re.M
    ), out
    for name in rows:
        row = re.search(rf"^{re.escape(name)}\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)\s+([\d,.]+)\s+([\d.]+)x$", out, re.M)
        assert row, (name, out)
        assert (int(row.group(1).replace(",", "")), int(row.group(2).replace(",", ""))) == tokens
        assert f"token counts {name}: OK" in out
    assert re.search(r"^kvledger\s.*\s1\.00x$", out, re.M)
    assert "memory-bandwidth floor" in out and re.search(r"floor\s+[\d.]+ s = [\d,]+ tok/s", out)
    assert ("decode profile (kvledger)" in out and "kvledger.* (union)" in out) == profiled


def test_cli_smoke_smollm2_cpu(tmp_path, capsys):
    out_json = tmp_path / "nano.json"
    rc = main(
        [
            "bench",
            "--workload",
            "nano-vllm",
            "--model-config",
            "smollm2-135m",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--num-requests",
            "3",
            "--max-input-len",
            "16",
            "--max-output-len",
            "4",
            "--profile-requests",
            "2",
            "--profile-output-len",
            "3",
            "--output",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    w = make_nano_workload(3, 16, 4)
    _check_table(out, [ENGINE_ROW], (w.input_tokens, w.output_tokens))

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
        "systems",
        "bandwidth",
        "floor",
        "breakdown",
        "ok",
    ):
        assert key in report, key
    assert report["ok"] and report["dtype"] == "float32" and report["device"] == "cpu"
    assert {"torch", "transformers"} <= set(report["versions"])
    (ours,) = report["systems"]
    assert ours["name"] == ENGINE_ROW and ours["output_tokens"] == w.output_tokens and ours["seconds"] > 0
    assert ours["tok_per_s"] == pytest.approx(ours["output_tokens"] / ours["seconds"])
    assert report["model"]["params"] == 134_515_008
    assert report["floor"]["decode_steps"] == max(w.max_tokens) and report["floor"]["seconds"] > 0
    assert report["bandwidth"]["bytes_per_s"] > 0
    b = report["breakdown"]
    assert b["decode_steps"] >= 1 and set(b["categories"]) == {"attention", "gemm", "all-reduce", "sampling", "other"}


def test_cli_runs_each_tensor_parallel_size_in_one_run(tmp_path, capsys):
    out_json = tmp_path / "nano.json"
    rc = main(
        [
            "bench",
            "--workload",
            "nano-vllm",
            "--model-config",
            "smollm2-135m",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--num-requests",
            "2",
            "--max-input-len",
            "16",
            "--max-output-len",
            "3",
            "--threads",
            "1",
            "--tp",
            "1,2",
            "--profile-requests",
            "2",
            "--profile-output-len",
            "3",
            "--output",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads(out_json.read_text())
    names = [r["name"] for r in report["systems"]]
    assert names == [f"{ENGINE_ROW} tp=1", f"{ENGINE_ROW} tp=2"]
    assert len({r["output_tokens"] for r in report["systems"]}) == 1 and report["ok"]
    assert f"{ENGINE_ROW} tp=2 over {ENGINE_ROW} tp=1:" in out
    per_size = report["breakdown_per_tp_size"]
    assert per_size["1"]["categories"]["all-reduce"]["ms_per_step"] == 0  # one rank: no collective
    assert per_size["2"]["categories"]["all-reduce"]["ms_per_step"] > 0  # rank 0's all-reduces, profiled


@pytest.mark.filterwarnings("ignore")
def test_cli_compare_transformers_per_request_lengths(tmp_path, capsys):
    out_json = tmp_path / "nano.json"
    rc = main(
        [
            "bench",
            "--workload",
            "nano-vllm",
            "--model-config",
            TINY,
            "--device",
            "cpu",
            "--num-requests",
            "4",
            "--max-input-len",
            "24",
            "--max-output-len",
            "12",
            "--profile-requests",
            "0",
            "--compare",
            "transformers",
            "-o",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    w = make_nano_workload(4, 24, 12)
    assert len(set(w.max_tokens)) > 1  # requests differ in max_tokens: each one must get its own
    _check_table(out, [ENGINE_ROW, HF_ROW], (w.input_tokens, w.output_tokens), profiled=False)
    report = json.loads(out_json.read_text())
    hf = report["systems"][1]
    assert hf["name"] == HF_ROW and hf["token_counts_ok"] and hf["mismatched_requests"] == 0
    assert hf["output_tokens"] == w.output_tokens
    assert report["ratio_ours_over_transformers"] > 0 and report["breakdown"] is None


def test_unknown_model_config_is_a_usage_error(capsys):
    rc = main(["bench", "--workload", "nano-vllm", "--model-config", "no-such-model", "--device", "cpu"])
    assert rc == 2
    assert "no model config 'no-such-model'" in capsys.readouterr().err


def test_cpu_dtype_defaults_to_float32():
    from kvledger.bench.nano import NanoOptions

    o = NanoOptions(device="cpu").resolve()
    assert o.dtype == "float32" and o.cuda_graphs is False and o.bandwidth_bytes == 64 << 20
    if torch.cuda.is_available():  # pragma: no cover - GPU machines
        assert NanoOptions(device="cuda").resolve().dtype == "bfloat16"
