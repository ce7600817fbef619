"""The two kernel sets a step can run on (engine/model/kernels.py) give the same logits: the fused
Triton path (norms, rotary and the KV store in one kernel, attention over the stored pool) against
eager PyTorch, over a prefill and the decode steps after it. On the CPU the Triton kernels run in
Triton's interpreter, so the CUDA path's wiring is checked without a GPU."""

import importlib.util

import pytest
import torch

from kvledger.engine.attention.base import AttentionBatch
from kvledger.engine.attention.torch_native import TorchNativeBackend
from kvledger.engine.model import fused_ops
from kvledger.engine.model.kernels import EagerKernels, FusedKernels, StepInputs
from kvledger.engine.model.kv_pool import KVPool
from kvledger.engine.model.model import CausalLM
from kvledger.engine.model.weights import random_state_dict
from tests.support.models import tiny_qwen3

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _model(fused: bool, monkeypatch) -> CausalLM:
    from kvledger.engine.attention.triton_paged import TritonPagedBackend

    config = tiny_qwen3()
    model = CausalLM.from_state_dict(config, random_state_dict(config, seed=7), device=DEVICE)
    model.kv_pool = KVPool.for_model(config, 512, torch.float32, DEVICE)
    model.attn_backend = TritonPagedBackend() if fused else TorchNativeBackend()
    if fused and DEVICE == "cpu":  # the interpreter runs the fused kernels on CPU tensors
        monkeypatch.setattr(fused_ops, "available", lambda t: True)
    return model


def _steps(model: CausalLM, prompts, decode_steps: int):
    """Logits of a prefill of every prompt, then of decode steps feeding back the greedy tokens."""
    rows = len(prompts)
    width = 128
    table = torch.arange(rows * width, dtype=torch.int32, device=DEVICE).view(rows, width) + 1
    lens = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p], device=DEVICE)
    batch = AttentionBatch.from_page_table(table, range(rows), [0] * rows, lens)
    logits = [model(ids, batch.positions, batch)]
    for _ in range(decode_steps):
        tokens = logits[-1].argmax(-1)
        batch = AttentionBatch.from_page_table(table, range(rows), lens, [n + 1 for n in lens])
        logits.append(model(tokens, batch.positions, batch))
        lens = [n + 1 for n in lens]
    return logits


def test_the_fused_kernels_give_the_eager_logits(monkeypatch):
    prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32], [38, 46, 26, 43], [11]]
    eager = _model(False, monkeypatch)
    want = _steps(eager, prompts, 3)
    fused = _model(True, monkeypatch)
    assert fused.uses_fused_path() and not eager.uses_fused_path()
    got = _steps(fused, prompts, 3)
    for step, (a, b) in enumerate(zip(want, got)):
        assert a.shape == b.shape == (len(prompts), eager.config.vocab_size)
        assert torch.allclose(a, b, atol=2e-4, rtol=1e-4), f"step {step}: max diff {(a - b).abs().max():.2e}"


def test_a_step_chooses_its_kernel_set_once(monkeypatch):
    eager = _model(False, monkeypatch)
    positions = torch.arange(4, device=DEVICE)
    step = StepInputs.build(eager, positions, positions, torch.float32)
    assert step.kernels is EagerKernels and step.cos is not None and step.inv_freq is None
    fused = _model(True, monkeypatch)
    step = StepInputs.build(fused, positions, positions, torch.float32)
    assert step.kernels is FusedKernels and step.inv_freq is not None and step.cos is None
