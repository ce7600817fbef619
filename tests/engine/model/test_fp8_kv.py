"""The FP8 (e4m3) KV cache on the CPU: the pool's round trip and clamping, calibrated scales, and
the engine over it (teacher-forced agreement with the bf16 cache on the embedded model)."""

from __future__ import annotations

import pytest
import torch

from kvledger.engine.model.kv_pool import FP8, FP8_MAX, KVPool
from kvledger.engine.model.kv_scales import HEADROOM, calibrate_kv_scales, calibration_ids
from kvledger.engine.options import EngineOptionError
from kvledger.engine.runtime.llm import LLM
from kvledger.fast import SamplingParams
from tests.support.models import tiny_config
from tests.support.paths import ROOT

TINY = tiny_config(vocab_size=307, intermediate_size=96, tie_word_embeddings=False)


def test_the_pool_stores_a_scaled_e4m3_value_and_reads_it_back_within_its_precision():
    pool = KVPool(2, 32, 2, 8, dtype=torch.bfloat16, kv_dtype=FP8, k_scales=[0.01, 0.5], v_scales=[0.02, 1.0])
    assert pool.quantized and pool.k_buffer.element_size() == 1 and pool.compute_dtype == torch.bfloat16
    g = torch.Generator().manual_seed(0)
    for layer, scale in ((0, 0.01), (1, 0.5)):
        k = (torch.randn(5, 2, 8, generator=g) * scale * 50).to(torch.bfloat16)
        v = (torch.randn(5, 2, 8, generator=g) * scale * 50).to(torch.bfloat16)
        loc = torch.tensor([3, 9, 10, 20, 31])
        pool.store(layer, loc, k, v)
        kk, vv = pool.gather(layer, loc)
        assert kk.dtype == torch.bfloat16 and kk.shape == (2, 5, 8)
        # e4m3 keeps 3 mantissa bits: a normal value is within 2^-4 of itself (plus bf16's rounding)
        rel = (kk.float() - k.transpose(0, 1).float()).abs() / k.transpose(0, 1).float().abs().clamp_min(1e-3)
        normal = (k.transpose(0, 1).float().abs() / scale) >= 2**-6
        assert rel[normal].max() <= 2**-4 + 2**-7
        assert torch.equal(pool.gather(layer, loc)[0], pool.round_trip(layer, k, v)[0].transpose(0, 1))
        # the raw bytes are value / scale in e4m3
        raw = pool.k[layer][:, loc].float()
        assert torch.equal(raw, (k.transpose(0, 1).float() / pool.k_scale[layer]).to(FP8).float())


def test_a_value_past_the_e4m3_range_saturates_instead_of_becoming_nan():
    pool = KVPool(1, 4, 1, 4, dtype=torch.float32, kv_dtype=FP8, k_scales=[1.0], v_scales=[1.0])
    big = torch.tensor([[[1e6, -1e6, 500.0, 3.0]]])
    pool.store(0, torch.tensor([1]), big, big)
    k, _ = pool.gather(0, torch.tensor([1]))
    assert k.flatten().tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX, 3.0]


def test_calibrated_scales_are_the_layers_peak_with_headroom_and_keep_values_out_of_subnormals():
    llm = LLM(None, kv_cache_dtype="fp8_e4m3", threads=1, max_seq_len=256, kv_cache_tokens=1024)
    model, pool = llm.model, llm.model.kv_pool
    ids = calibration_ids(llm.model_config.vocab_size)
    k_scales, v_scales = calibrate_kv_scales(model, ids)
    assert (k_scales, v_scales) == (pool.k_scale, pool.v_scale)  # what the engine set at load
    # the same prefill through a plain pool: each scale is 2x its layer's peak over 448
    plain = KVPool(len(pool.k), len(ids), pool.k[0].shape[0], pool.k[0].shape[-1], torch.float32)
    from kvledger.engine.attention.base import AttentionBatch

    table = torch.arange(len(ids), dtype=torch.int32).view(1, -1)
    attn = AttentionBatch.from_page_table(table, [0], [0], [len(ids)])
    model.kv_pool = plain
    model(ids, attn.positions, attn)
    model.kv_pool = pool
    for layer in range(len(plain.v)):
        peak = float(plain.v[layer][:, : len(ids)].abs().max())
        assert v_scales[layer] == pytest.approx(peak * HEADROOM / FP8_MAX)
        stored = plain.v[layer][:, : len(ids)].abs() / v_scales[layer]
        assert float((stored[stored > 0] < 2**-6).float().mean()) < 0.05  # scale 1.0 leaves 47% in layer 0


def test_fp8_engine_agrees_with_the_bf16_cache_teacher_forced_on_real_text():
    from kvledger.bench.kv_accuracy import compare

    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    r = compare([text], chunk=256, min_positions=500, threads=1)
    assert r["positions"] >= 500
    # measured 94.6% and 0.0076 nats (docs/benchmarks.md); a scale applied twice or not at all falls far below
    assert r["top1_agreement"] >= 0.9 and r["kl_mean"] < 0.02


def test_the_fp8_pool_holds_half_the_bytes_and_the_ledger_is_unchanged():
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8] * 3, [9, 10, 11] * 5]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    pools = {}
    for kv in ("auto", "fp8_e4m3"):
        with LLM(
            TINY,
            dummy_weights=True,
            dtype="bfloat16",
            kv_cache_dtype=kv,
            threads=1,
            verify=True,
            page_size=4,
            kv_cache_tokens=256,
        ) as llm:
            outs = llm.generate(prompts, params)
            assert all(len(o.token_ids) == 6 for o in outs)
            pools[kv] = llm.model.kv_pool.k_buffer.nbytes + llm.model.kv_pool.v_buffer.nbytes
    assert pools["fp8_e4m3"] * 2 == pools["auto"]


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_option():
    with pytest.raises(EngineOptionError, match="kv_cache_dtype must be one of 'auto', 'fp8_e4m3'"):
        LLM(kv_cache_dtype="fp16")
