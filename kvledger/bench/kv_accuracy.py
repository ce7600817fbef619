"""FP8 KV accuracy: next-token distributions with an e4m3 cache against the model-dtype cache.

`python -m kvledger.bench.kv_accuracy --text README.md --text ARCHITECTURE.md` runs real text
through the embedded SmolLM2 (or `--model`) twice, teacher-forced in chunks: once over a KV pool
that stores bf16 and once over an FP8 pool with calibrated scales (engine/model/kv_scales.py); the
weights and activations are float32 both times, so the difference is the cache's alone (and the
CPU, without AVX-512 BF16, runs float32 matmuls several times faster than bf16 ones). Every
position attends over the KV as the pool returns it, so each of the FP8 run's positions reads
quantized keys and values. Printed: positions compared, top-1 agreement, and the mean and 99th
percentile of KL(p_bf16 || p_fp8) of the next-token distribution; for scale, the top-1 agreement
of the bf16 cache itself with a float32 one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import List, Sequence

import torch

from kvledger.engine.attention.base import AttentionBatch
from kvledger.engine.model.kv_pool import KVPool
from kvledger.engine.runtime.llm import LLM


def chunks(ids: Sequence[int], size: int) -> List[List[int]]:
    return [list(ids[i : i + size]) for i in range(0, len(ids) - 1, size) if len(ids[i : i + size]) > 1]


@torch.inference_mode()
def chunk_logits(model, pool: KVPool, ids: List[int]) -> torch.Tensor:
    """[n, vocab] float32 logits of every position of `ids`, one prefill over `pool`."""
    n = len(ids)
    table = torch.arange(n, dtype=torch.int32).view(1, n)
    attn = AttentionBatch.from_page_table(table, [0], [0], [n])
    model.kv_pool = pool
    return model(torch.tensor(ids), attn.positions, attn, all_logits=True)


def compare(
    texts: Sequence[str], model=None, chunk: int = 512, min_positions: int = 10_000, threads: int | None = None
) -> dict:
    llm = LLM(model, kv_cache_tokens=chunk, kv_cache_dtype="fp8_e4m3", threads=threads)  # calibrates its scales
    fp8, tokenizer = llm.model.kv_pool, llm.tokenizer
    if fp8 is None or tokenizer is None:
        raise ValueError(f"{model}: the FP8 comparison needs the model's KV pool and its tokenizer")
    bf16 = KVPool.for_model(llm.model_config, fp8.num_tokens, torch.float32, kv_dtype=torch.bfloat16)
    f32 = KVPool.for_model(llm.model_config, fp8.num_tokens, torch.float32)  # what bf16 itself loses, for scale
    ids = [t for text in texts for t in tokenizer.encode(text)]
    agree, agree_bf16, kls = 0, 0, []
    for part in chunks(ids, chunk):
        a, b = chunk_logits(llm.model, bf16, part), chunk_logits(llm.model, fp8, part)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        agree_bf16 += int((a.argmax(-1) == chunk_logits(llm.model, f32, part).argmax(-1)).sum())
        pa, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        kls += (pa.exp() * (pa - lb)).sum(-1).clamp_min(0).tolist()
    n = len(kls)
    if n < min_positions:
        raise ValueError(f"the text gives {n} positions, fewer than {min_positions}: pass more --text")
    return {
        "positions": n,
        "top1_agreement": agree / n,
        "bf16_vs_float32_top1_agreement": agree_bf16 / n,
        "kl_mean": statistics.fmean(kls),
        "kl_p99": statistics.quantiles(kls, n=100)[98],
        "k_scales": fp8.k_scale,
        "v_scales": fp8.v_scale,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvledger.bench.kv_accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--text", action="append", required=True, help="a text file (repeat for more)")
    p.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory (default: the embedded model)")
    p.add_argument("--chunk", type=int, default=512, help="tokens per teacher-forced prefill")
    p.add_argument("--min-positions", type=int, default=10_000, help="fail unless the text gives this many")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    texts = []
    for path in args.text:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    try:
        r = compare(texts, args.model, args.chunk, args.min_positions, args.threads)
    except ValueError as e:
        print(f"kv_accuracy: {e}", file=sys.stderr)
        return 2
    print(
        f"FP8 (e4m3, calibrated per-layer scales) vs bf16 KV, float32 weights and activations: "
        f"{r['positions']:,} positions of real text, teacher-forced in {args.chunk}-token chunks"
    )
    print(f"  top-1 agreement      {100 * r['top1_agreement']:.2f}%")
    print(f"  KL(bf16 || fp8)      mean {r['kl_mean']:.5f} nats, p99 {r['kl_p99']:.5f}")
    print(
        f"  for scale: a bf16 cache against a float32 one, top-1 agreement "
        f"{100 * r['bf16_vs_float32_top1_agreement']:.2f}%"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
