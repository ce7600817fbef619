"""FlashInfer's paged decode as a benchmark-only peer of kvledger's decode kernels (CUDA only).

`kvledger.bench.decode_kernels peers` runs it on the pool it shares with kvledger's kernels and
FlashAttention-3. FlashInfer is never a dependency: on the GPU machine it comes from the archive
`kvledger.bench.flashinfer_pack` writes (its Python package with the decode modules prebuilt as
AOT modules), unpacked onto PYTHONPATH with its `apache-tvm-ffi` wheel.

`FlashInferDecode` is `BatchDecodeWithPagedKVCacheWrapper` planned once for a batch: NHD pages
([pages, page size, KV heads, head dim], the token-major pool viewed as pages), bf16 query and
output, bf16 or FP8 e4m3 KV with per-tensor scales. `tensor_cores=False` is the wrapper's
CUDA-core decode kernel (FlashInfer's default); `tensor_cores=True` decodes with its FA2 prefill
kernel, as vLLM's FlashInfer backend does (it sets `use_tensor_cores=True`). Either way the
backend is named (`fa2`), so nothing routes to cuDNN or CuTe-DSL, which the device lacks.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import List, Optional

import torch

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended float workspace for split-KV partials


def import_flashinfer() -> ModuleType:
    """Import FlashInfer. Its JIT cache goes under the temporary directory (the GPU machine is bare
    each call), and tvm-ffi is kept from compiling its optional torch DLPack add-on at import (a
    host-side speed-up of argument passing; the timings replay CUDA graphs, where it plays no part)."""
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", os.environ.get("TMPDIR", "/tmp"))
    os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    import flashinfer

    return flashinfer


class FlashInferDecode:
    """One planned decode batch: `block_table[b, :pages(lens[b])]` are request b's pages."""

    def __init__(
        self,
        flashinfer: ModuleType,
        block_table: torch.Tensor,
        lens: List[int],
        heads: int,
        kv_heads: int,
        head_dim: int,
        page: int,
        kv_dtype: torch.dtype,
        tensor_cores: bool,
    ) -> None:
        device = block_table.device
        pages = [-(-n // page) for n in lens]
        indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
        indices = torch.cat([block_table[b, :n] for b, n in enumerate(pages)]).to(torch.int32).contiguous()
        last = torch.tensor([(n - 1) % page + 1 for n in lens], dtype=torch.int32, device=device)
        self.fp8 = kv_dtype == torch.float8_e4m3fn
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device),
            "NHD",
            use_tensor_cores=tensor_cores,
            backend="fa2",
        )
        self.wrapper.plan(
            indptr,
            indices,
            last,
            heads,
            kv_heads,
            head_dim,
            page,
            q_data_type=torch.bfloat16,
            kv_data_type=kv_dtype,
            o_data_type=torch.bfloat16,
        )

    def __call__(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, k_scale: float, v_scale: float
    ) -> torch.Tensor:
        """q [B, heads, D] bf16 over NHD pages; FP8 values read back as value * scale."""
        scales: dict[str, Optional[float]] = {"k_scale": k_scale, "v_scale": v_scale} if self.fp8 else {}
        return self.wrapper.run(q, (k_pages, v_pages), **scales)
