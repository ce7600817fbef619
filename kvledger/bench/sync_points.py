"""Where the engine's steps make the host wait on the GPU: every synchronizing CUDA call, by stack.

    python -m kvledger.bench.sync_points --model-config smollm2-135m [--num-requests 256] [--top 12]

With overlap, the host prepares step N+1 while the GPU runs step N; a call that synchronizes (a
pageable device-to-host copy, `.item()`, `.tolist()` of a CUDA tensor, a blocking `.cpu()`) drains
the GPU's queue first, and the step then costs host and GPU time added rather than overlapped. A
profile shows such copies (`Memcpy DtoH (Device -> Pageable)`) but not who made them. This runs the
nano-vllm workload's first requests through the engine (random weights, CUDA graphs) with PyTorch's
sync debug mode (`torch.cuda.set_sync_debug_mode`) on, and counts each synchronizing call by the
engine's frames of its Python stack. Prints numbers; needs CUDA.
"""

from __future__ import annotations

import argparse
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, List, Optional, Tuple

import torch

import kvledger
from kvledger.bench.runner import resolve_model_config, step_loop
from kvledger.bench.workloads import NANO_MAX_LEN, nano_vllm

PAGE_SIZE = 16
MAX_RUNNING_REQ = 256
MAX_PREFILL_TOKENS = 16384  # the nano-vllm bench's engine settings (kvledger/bench/runner.py)
# the folders whose frames name a call site (the package's own layers, wherever they are installed)
_OURS = tuple(str(Path(p)) for p in kvledger.__path__) + tuple(
    str(Path(kvledger.__file__).parent.parent / d) for d in ("engine", "fast", "reference", "properties")
)
_SYNC_WARNING = "synchronizing"  # PyTorch's sync debug mode warns "called a synchronizing CUDA operation"


def call_site(stack: List[traceback.FrameSummary], depth: int = 4) -> Tuple[str, ...]:
    """The innermost `depth` frames of the package's own code, innermost first."""
    ours = [f for f in reversed(stack) if f.filename.startswith(_OURS) and not f.filename.endswith("sync_points.py")]
    return tuple(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in ours[:depth])


class SyncCounter:
    """Counts the synchronizing calls PyTorch warns of, by call site, while active."""

    def __init__(self) -> None:
        self.sites: Counter[Tuple[str, ...]] = Counter()
        self._previous: Any = None

    def __enter__(self) -> "SyncCounter":
        self._previous = warnings.showwarning
        warnings.simplefilter("always")
        warnings.showwarning = self._show  # type: ignore[assignment]
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._previous

    def _show(
        self, message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
    ) -> None:
        if _SYNC_WARNING in str(message):
            self.sites[call_site(traceback.extract_stack()[:-1]) or (f"{Path(filename).name}:{lineno}",)] += 1
        else:
            self._previous(message, category, filename, lineno, file, line)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-config", default="smollm2-135m", help="a shipped config name or a config .json")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("sync_points: needs a CUDA device")
    from kvledger.engine.runtime.llm import LLM
    from kvledger.fast import SamplingParams

    path = resolve_model_config(args.model_config)[2]
    workload = nano_vllm(args.num_requests, seed=0)
    kv_tokens = sum(len(p) + m for p, m in zip(workload.prompts, workload.max_tokens)) + MAX_RUNNING_REQ * PAGE_SIZE
    llm = LLM(
        str(path),
        dummy_weights=True,
        device="cuda",
        dtype="bfloat16",
        kv_cache_dtype=args.kv_cache_dtype,
        page_size=PAGE_SIZE,
        kv_cache_tokens=kv_tokens,
        max_running_req=MAX_RUNNING_REQ,
        max_prefill_tokens=MAX_PREFILL_TOKENS,
        max_seq_len=2 * NANO_MAX_LEN + PAGE_SIZE,
    )
    try:
        engine = llm.engine
        warm = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)] * 8
        llm.generate(workload.prompts[:8], warm, use_tqdm=False)  # Triton kernels, CUDA graphs
        steps_before = dict(engine.steps)
        with SyncCounter() as counter:
            step_loop(llm, workload, first_uid=engine.next_uid())
        steps = {k: v - steps_before[k] for k, v in engine.steps.items()}
    finally:
        llm.close()
    total_steps = max(1, sum(steps.values()))
    total = sum(counter.sites.values())
    print(f"{args.model_config}, {args.num_requests} requests of the nano-vllm workload, random weights, CUDA graphs")
    print(f"steps: {steps}; synchronizing calls: {total:,} ({total / total_steps:.2f} per step)")
    for site, n in counter.sites.most_common(args.top):
        print(f"  {n:>8,}  {n / total_steps:6.2f}/step  " + "  <-  ".join(site))


if __name__ == "__main__":
    main()
