"""The memory-bandwidth floor of the nano-vllm workload's decode, and the bandwidth it is measured
against (a device-to-device copy in the same run).

Every decode step reads all weights once and every running request's KV context; the workload's
schedule is taken analytically (every request decodes from step 1, request i for max_tokens[i]
steps), which is what the issue's floor counts.
"""

from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from kvledger.engine.model.config import ModelConfig


def param_count(c: ModelConfig) -> int:
    """Parameters of the model (the engine's shapes; tied embeddings counted once)."""
    h = c.hidden_size
    layer = (
        2 * h  # input and post-attention norms
        + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * h  # q, k, v
        + h * c.num_heads * c.head_dim  # o
        + (2 * c.head_dim if c.qk_norm else 0)
        + 2 * c.intermediate_size * h
        + h * c.intermediate_size
    )  # gate+up, down
    vocab = c.vocab_size * h * (1 if c.tie_word_embeddings else 2)
    return vocab + h + c.num_layers * layer


def weight_bytes_per_step(c: ModelConfig, itemsize: int) -> int:
    """Weight bytes one decode step reads: every weight once, the vocabulary matrix once (the LM head).

    An untied input embedding table is not counted: a step gathers only its batch's rows."""
    untied_embedding = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    return (param_count(c) - untied_embedding) * itemsize


def kv_bytes_per_token(c: ModelConfig, itemsize: int) -> int:
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * itemsize


def decode_floor(
    c: ModelConfig,
    itemsize: int,
    prompt_lens: Sequence[int],
    max_tokens: Sequence[int],
    bytes_per_s: float,
    kv_itemsize: Optional[int] = None,
) -> Dict[str, Any]:
    """The memory-bandwidth floor of the workload's decode (`kv_itemsize`: bytes per KV value when
    the cache stores another dtype than the weights, 1 for FP8).

    Schedule (analytic): every request decodes from step 1; request i runs max_tokens[i] steps and at
    step s reads its context of prompt_lens[i] + s tokens. Every step reads all weights once.
    """
    steps = max(max_tokens) if max_tokens else 0
    # sum over s = 1..m of (p + s) = m * p + m (m + 1) / 2
    kv_tokens = sum(m * p + m * (m + 1) // 2 for p, m in zip(prompt_lens, max_tokens))
    w = weight_bytes_per_step(c, itemsize)
    kvb = kv_bytes_per_token(c, kv_itemsize or itemsize)
    total = steps * w + kv_tokens * kvb
    seconds = total / bytes_per_s if bytes_per_s > 0 else float("nan")
    out_tokens = sum(max_tokens)
    return {
        "params": param_count(c),
        "itemsize": itemsize,
        "weight_bytes_per_step": w,
        "kv_bytes_per_token": kvb,
        "decode_steps": steps,
        "kv_tokens_read": kv_tokens,
        "weight_bytes": steps * w,
        "kv_bytes": kv_tokens * kvb,
        "total_bytes": total,
        "bandwidth_bytes_per_s": bytes_per_s,
        "seconds": seconds,
        "tok_per_s": out_tokens / seconds if seconds and seconds > 0 else float("nan"),
    }


def measure_bandwidth(device: str, nbytes: int, repeats: int = 5) -> Dict[str, Any]:
    """Copy bandwidth, (read + write) bytes over time of one dst.copy_(src), best of `repeats`."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    best = math.inf
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    del src, dst
    if cuda:
        torch.cuda.empty_cache()
    return {
        "source": "measured",
        "method": f"{dev.type} copy of {nbytes} bytes, read+write, best of {repeats}",
        "copy_bytes": nbytes,
        "seconds": best,
        "bytes_per_s": 2 * nbytes / best,
    }


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n:.0f} B"


def format_floor(floor: Dict[str, Any], bandwidth: Dict[str, Any], our_seconds: Optional[float]) -> List[str]:
    lines = [
        "memory-bandwidth floor (every request decoding from step 1; each step reads all weights and all KV):",
        f"  weights per step      {_fmt_bytes(floor['weight_bytes_per_step'])} "
        f"({floor['params']:,} params x {floor['itemsize']} B, tied embeddings once)",
        f"  KV per token          {floor['kv_bytes_per_token']:,} B",
        f"  decode steps          {floor['decode_steps']:,}; KV tokens read {floor['kv_tokens_read']:,}",
        f"  bytes to read         {_fmt_bytes(floor['total_bytes'])} (weights {_fmt_bytes(floor['weight_bytes'])}, "
        f"KV {_fmt_bytes(floor['kv_bytes'])})",
        f"  bandwidth             {bandwidth['bytes_per_s'] / 1e9:,.1f} GB/s ({bandwidth['method']})",
    ]
    frac = floor["seconds"] / our_seconds if our_seconds else float("nan")
    lines.append(
        f"  floor                 {floor['seconds']:.3f} s = {floor['tok_per_s']:,.0f} tok/s; "
        f"kvledger reaches {frac:.3f} of it (floor s / our s)"
    )
    return lines
