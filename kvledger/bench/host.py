"""`kvledger bench host`: the engine's host cost per step, with the model's work taken out. Prints
numbers; asserts nothing but that every request got its tokens.

The nano-vllm workload (`workloads.nano_vllm`) runs through the real engine (scheduler, cache
scheduler over `fast`, overlap as on CUDA, postprocess, operation stream). What is measured is what
the host spends per step, which on a GPU overlaps with the step's kernels and, once a step's
kernels take less, sets the pace (SmolLM2-135M on an H200: docs/benchmarks.md).

- `--device cpu` (the default without CUDA): the model runner's forward returns token 0 for every
  sampled row and computes nothing.
- `--device cuda`: the model runs, one tiny layer in bf16 with CUDA graphs, so the GPU path's host
  work (metadata copies, graph replays, pinned token copies, events) is in the figures while the
  GPU's share of a step stays small (its wait is the `wait` column).

`--cprofile` adds cProfile's top functions by their own time (cProfile slows every Python call,
so its times are for ranking, not for the per-step figures above them).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch

from kvledger.bench.runner import LoopResult, step_loop
from kvledger.bench.workloads import NANO_MAX_LEN, NANO_NUM_REQUESTS, NANO_VOCAB_MAX, nano_vllm
from kvledger.engine.model.config import ModelConfig

PAGE_SIZE = 16
MAX_RUNNING_REQ = 256
MAX_PREFILL_TOKENS = 16384  # the nano-vllm bench's engine settings (kvledger/bench/runner.py)
MODEL_ON = {"cpu": "model stubbed out", "cuda": "one tiny bf16 layer, CUDA graphs"}


@dataclass
class HostCost:
    device: str
    requests: int
    steps: int
    seconds: float
    host_ms: Dict[str, float]  # per step: schedule, complete, land, wait (engine.host_seconds)
    tokens: int
    expected_tokens: int

    @property
    def ms_per_step(self) -> float:
        return self.seconds * 1e3 / self.steps

    def lines(self) -> List[str]:
        parts = ", ".join(f"{k} {v:.3f}" for k, v in self.host_ms.items())
        status = "OK" if self.tokens == self.expected_tokens else "MISMATCH"
        return [
            f"host cost on {self.device} ({MODEL_ON[self.device]}): {self.requests} requests of the nano-vllm "
            f"workload, page size {PAGE_SIZE}, at most {MAX_RUNNING_REQ} running",
            f"  {self.steps:,} steps in {self.seconds:.2f} s: {self.ms_per_step:.3f} ms per step; host ms per step: "
            f"{parts}",
            f"  token counts: {status} ({self.tokens:,} of {self.expected_tokens:,})",
        ]


def stub_config() -> ModelConfig:
    """One small layer with the workload's vocabulary: building it is quick, and it never runs."""
    return ModelConfig(
        arch="qwen3",
        vocab_size=NANO_VOCAB_MAX + 1,
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
        max_position_embeddings=4 * NANO_MAX_LEN,
        bos_token_id=None,
        eos_token_ids=(0,),
    )


def warmup_params() -> List[Any]:
    from kvledger.fast import SamplingParams

    return [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)] * 8


def _stub_forward(batch: Any, may_share: bool) -> Tuple[None, torch.Tensor]:
    return None, torch.zeros(len(batch.sampled), dtype=torch.long)


def measure(
    num_requests: int = NANO_NUM_REQUESTS, seed: int = 0, profile: bool = False, device: str = "cpu"
) -> Tuple[HostCost, str]:
    """Run the workload once; returns the cost and cProfile's report ('' unless `profile`)."""
    from kvledger.engine.runtime.llm import LLM

    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")
    workload = nano_vllm(num_requests, seed=seed)
    kv_tokens = sum(len(p) + m for p, m in zip(workload.prompts, workload.max_tokens)) + MAX_RUNNING_REQ * PAGE_SIZE
    llm = LLM(
        stub_config(),
        dummy_weights=True,
        device=device,
        dtype="float32" if device == "cpu" else "bfloat16",
        page_size=PAGE_SIZE,
        kv_cache_tokens=kv_tokens,
        max_running_req=MAX_RUNNING_REQ,
        max_prefill_tokens=MAX_PREFILL_TOKENS,
        max_seq_len=2 * NANO_MAX_LEN + PAGE_SIZE,
        overlap=True,  # as on CUDA: step N's bookkeeping runs on placeholders, its tokens land a step later
    )
    try:
        engine = llm.engine
        if device == "cpu":
            setattr(engine.runner, "forward", _stub_forward)  # noqa: B010 (an instance's method, stubbed)
        else:
            llm.generate(workload.prompts[:8], warmup_params(), use_tqdm=False)  # Triton kernels, graphs
        before = dict(engine.host_seconds)
        steps_before = sum(engine.steps.values())
        profiler = cProfile.Profile() if profile else None
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        result: LoopResult = step_loop(llm, workload, first_uid=engine.next_uid())  # after the warm-up's uids
        if profiler is not None:
            profiler.disable()
        seconds = time.perf_counter() - start
        steps = sum(engine.steps.values()) - steps_before
        host_ms = {k: (v - before[k]) * 1e3 / steps for k, v in engine.host_seconds.items()}
    finally:
        llm.close()
    report = ""
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
        report = out.getvalue()
    tokens = sum(len(o) for o in result.outputs)
    cost = HostCost(device, num_requests, steps, seconds, host_ms, tokens, sum(workload.max_tokens))
    return cost, report


def main(num_requests: int = NANO_NUM_REQUESTS, seed: int = 0, profile: bool = False, device: str = "cpu") -> HostCost:
    cost, report = measure(num_requests, seed, profile, device)
    for line in cost.lines():
        print(line)
    if report:
        print(report)
    return cost
