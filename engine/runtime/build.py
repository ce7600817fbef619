"""Build one rank's engine from an EngineConfig: weights (this rank's share), model, KV pool, engine.

`LLM` builds rank 0 (the only rank without tensor parallelism); the other ranks of a
tensor-parallel engine build theirs with the same function, so every rank's pool, page table
and scheduler options come out equal. Where a rank could decide alone and differ (the pool size
from its free memory, the EOS ids from rank 0's tokenizer), rank 0's or the smallest value wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from kvledger.engine.distributed.group import TensorParallelGroup
from kvledger.engine.distributed.replicated_engine import RankCoordination, RankHook, ReplicatedEngine
from kvledger.engine.engine_config import EngineConfig
from kvledger.engine.model.config import ModelConfig
from kvledger.engine.model.kv_pool import KV_CACHE_DTYPES, KVPool
from kvledger.engine.model.kv_scales import calibrate_kv_scales, calibration_ids
from kvledger.engine.model.model import CausalLM
from kvledger.engine.model.weights import load_weights
from kvledger.engine.options import DTYPE_NAMES, validate_for_model
from kvledger.engine.runtime.engine import Engine

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass
class RankEngine:
    model_config: ModelConfig
    model: CausalLM
    engine: Engine
    coordination: Optional[RankCoordination]  # None without tensor parallelism

    def rank_coordination(self) -> RankCoordination:
        """The coordination of a tensor-parallel rank."""
        if self.coordination is None:
            raise RuntimeError("not a rank of a tensor-parallel engine")
        return self.coordination


def rank_device(device: str, local_rank: int, tp_size: int) -> str:
    """Rank r of a tensor-parallel engine on CUDA runs on cuda:r (cuda:LOCAL_RANK under torchrun)."""
    if tp_size > 1 and torch.device(device).type == "cuda":
        return f"cuda:{local_rank}"
    return device


def build_rank(
    o: EngineConfig,
    tp: TensorParallelGroup,
    device: str,
    eos: Optional[Iterable[int]] = None,
    hook: Optional[RankHook] = None,
) -> RankEngine:
    """`eos`: rank 0's EOS ids (from its tokenizer; None: the model config's); the other ranks
    receive rank 0's."""
    if o.threads is not None:
        torch.set_num_threads(o.threads)
    if torch.device(device).type == "cuda" and torch.device(device).index is not None:
        torch.cuda.set_device(torch.device(device))  # a rank's own GPU: kernels and NCCL run there
    config, state = load_weights(o.model, dummy=o.dummy_weights, seed=o.seed, shard=tp.shard, device=device)
    validate_for_model(o.max_seq_len, config, tp.size)
    dtype = DTYPES[o.dtype]
    model = CausalLM.from_state_dict(config, state, dtype=dtype, device=device, tp=tp)
    model.attn_backend = _attention_backend(
        o.attention, device, cascade=o.cascade_attention and o.cache_type == "radix", fp8_decode=o.fp8_decode_kernel
    )
    del state
    kv_heads = len(tp.shard.kv_heads(config))
    kv_dtype = KV_CACHE_DTYPES[o.kv_cache_dtype] or dtype
    kv_tokens = o.kv_cache_tokens
    if kv_tokens is None:
        # shadow verification compares every page after every operation: keep its pool small
        kv_tokens = (
            32768
            if o.verify
            else _auto_kv_tokens(config, dtype, kv_dtype, device, o.max_running_req, o.max_prefill_tokens, kv_heads)
        )
        if tp.distributed:  # every rank must hold the same pages: the smallest pool wins
            kv_tokens = min(tp.all_gather(kv_tokens))
    num_pages = max(1, kv_tokens // o.page_size)  # the automatic size may be under a page
    model.kv_pool = KVPool.for_model(
        config, num_pages * o.page_size, dtype, device, kv_heads=kv_heads, kv_dtype=kv_dtype
    )
    if model.kv_pool.quantized:
        model.kv_pool.k_scale, model.kv_pool.v_scale = calibrate_kv_scales(model, calibration_ids(config.vocab_size))
    if eos is None:
        eos = config.eos_token_ids
    if tp.distributed:
        eos = tp.broadcast(list(eos))
    resolved = o.resolve(
        num_pages, min(config.max_position_embeddings, 4096) if o.max_seq_len is None else o.max_seq_len
    )
    coordination = RankCoordination(tp, o.verify, hook) if tp.distributed else None
    if coordination is not None and tp.rank == 0:
        engine: Engine = ReplicatedEngine(
            model, resolved, eos, device, overlap=o.overlap, cuda_graphs=o.cuda_graphs, coordination=coordination
        )
    else:
        engine = Engine(model, resolved, eos, device, overlap=o.overlap, cuda_graphs=o.cuda_graphs)
    # a real forward error may strike one rank only: its peers would wait in a collective that never meets
    engine.contain_errors = not tp.distributed
    engine.capture_graphs()
    return RankEngine(config, model, engine, coordination)


def _auto_kv_tokens(
    config: ModelConfig,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device: str,
    max_running_req: int,
    max_prefill_tokens: int,
    kv_heads: int,
) -> int:
    if torch.device(device).type != "cuda":
        return 32768
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    # logits in float32 (and the model dtype) for a full decode batch or a prefill's last tokens,
    # a prefill's activations, and the CUDA graphs' pool
    batch = max(max_running_req, 256)
    logits = batch * config.vocab_size * (4 + dtype.itemsize) * 2
    activations = max_prefill_tokens * (config.hidden_size * 8 + config.intermediate_size * 6) * 4
    reserve = logits + activations + (2 << 30)
    return KVPool.tokens_that_fit(config, kv_dtype, free, fraction=0.9, reserve_bytes=reserve, kv_heads=kv_heads)


def _attention_backend(name: str, device: str, cascade: bool = False, fp8_decode: str = "cuda"):
    """auto: the Triton kernel on CUDA, torch-native (gathered KV + SDPA) on the CPU. cascade: the
    Triton decode kernel reads shared prefixes once per group (only a radix cache shares pages);
    fp8_decode: the Triton backend's decode over an FP8 pool ("cuda" or "triton")."""
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name == "torch":
        from kvledger.engine.attention.torch_native import TorchNativeBackend

        return TorchNativeBackend()
    if name == "triton":
        from kvledger.engine.attention.triton_paged import TritonPagedBackend

        return TritonPagedBackend(cascade=cascade, fp8_decode=fp8_decode)
    raise ValueError(f"attention must be 'auto', 'torch' or 'triton', got {name!r}")
