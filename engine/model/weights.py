"""Load model weights as (ModelConfig, state dict with our parameter names).

Sources: a GGUF file (dequantized with the `gguf` package, then cached as float32
safetensors), a Hugging Face directory (config.json + *.safetensors), or random
weights from a config (`dummy=True`, for speed benchmarks).

Our names (see engine/model/model.py): q/k/v are fused into `qkv_proj` and gate/up into
`gate_up_proj`, so each layer runs two fewer matmuls.

Under tensor parallelism (`shard=`), a rank reads only its part of each weight: safetensors
files (a Hugging Face directory, or the float32 cache of a GGUF) through `safe_open` slices, and
random weights are drawn whole one tensor at a time (the same values as with one rank) and cut at
once, so no rank ever holds the whole model.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvledger.engine.distributed.partition import FusedRows, TensorParallelShard
from kvledger.engine.model.config import BUILTIN_CONFIG_DIR, ModelConfig
from kvledger.engine.model.default_model import default_model_path

StateDict = dict[str, torch.Tensor]

CACHE_VERSION = 1  # bump when the cached layout or naming changes
_CACHE_WEIGHTS = "kvledger.safetensors"
_CACHE_META = "kvledger.json"


# ---------------------------------------------------------------------------- cache


def cache_root() -> Path:
    env = os.environ.get("KVLEDGER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvledger"


def file_fingerprint(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """First 16 hex digits of sha256(size, first MiB, last MiB).

    Hashing a multi-GB GGUF in full would cost seconds on every start; the header
    (metadata, tensor table with offsets) lives in the first MiB and any other
    quantization changes the size, so this is a cheap and good-enough identity.
    mtime is deliberately left out so a reinstalled or copied file reuses the cache.
    """
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(chunk))
        if size > chunk:
            f.seek(max(chunk, size - chunk))
            h.update(f.read(chunk))
    return h.hexdigest()[:16]


def cache_dir_for(path: str | os.PathLike) -> Path:
    return cache_root() / file_fingerprint(path)


def _atomic_write(dest: Path, write) -> None:
    """Write via a temp file in the same directory then rename, so readers never see half a file."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _read_cache_meta(cache: Path) -> dict | None:
    meta = cache / _CACHE_META
    if not meta.is_file() or not (cache / _CACHE_WEIGHTS).is_file():
        return None
    data = json.loads(meta.read_text())
    return data if data.get("version") == CACHE_VERSION else None


def _read_cache(cache: Path) -> tuple[ModelConfig, StateDict] | None:
    if _read_cache_meta(cache) is None:
        return None
    config = ModelConfig.from_json(cache / "config.json")
    return config, load_file(cache / _CACHE_WEIGHTS)


def _write_cache(cache: Path, config: ModelConfig, state: StateDict, source: str) -> None:
    _atomic_write(cache / _CACHE_WEIGHTS, lambda p: save_file(state, p))
    _atomic_write(cache / "config.json", lambda p: Path(p).write_text(json.dumps(config.to_hf_config(), indent=2)))
    # The meta file goes last: its presence marks the cache complete.
    meta = {"version": CACHE_VERSION, "source": source}
    _atomic_write(cache / _CACHE_META, lambda p: Path(p).write_text(json.dumps(meta)))


# ---------------------------------------------------------------------------- naming

_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_RENAME = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_attn_norm.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
_HF_FUSED = {  # our fused name -> the HF pieces concatenated along the output dim
    "attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def convert_hf_state_dict(config: ModelConfig, hf: StateDict) -> StateDict:
    """Hugging Face Llama/Qwen3 parameter names -> ours."""
    out: StateDict = {
        "embed_tokens.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = hf["lm_head.weight"]
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in hf.items():
        m = _HF_LAYER.fullmatch(name)
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = t
    for i in range(config.num_layers):
        p = layers[i]
        for hf_name, ours in _HF_RENAME.items():
            if hf_name in p:
                out[f"layers.{i}.{ours}"] = p[hf_name]
        for ours, parts in _HF_FUSED.items():
            out[f"layers.{i}.{ours}"] = torch.cat([p[x] for x in parts], dim=0)
    return out


_GGUF_RENAME = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _gguf_to_hf_name(name: str) -> str:
    base, suffix = name.rsplit(".", 1)
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m:
        return f"model.layers.{m.group(1)}.{_GGUF_RENAME[m.group(2)]}.{suffix}"
    return f"{_GGUF_RENAME[base]}.{suffix}"


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves each Llama head's q/k rows for its rope layout; undo it.
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


# ---------------------------------------------------------------------------- GGUF


def _gguf_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader) -> ModelConfig:
    arch = _gguf_value(reader, "general.architecture")
    if arch not in ("llama", "qwen3"):
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported")

    def g(key: str, default=None):
        return _gguf_value(reader, f"{arch}.{key}", default)

    hidden, heads = g("embedding_length"), g("attention.head_count")
    vocab = g("vocab_size") or len(_gguf_value(reader, "tokenizer.ggml.tokens"))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    eos = _gguf_value(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        arch=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=g("feed_forward_length"),
        num_layers=g("block_count"),
        num_heads=heads,
        num_kv_heads=g("attention.head_count_kv", heads),
        head_dim=g("attention.key_length") or hidden // heads,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon")),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        tie_word_embeddings=not has_output,
        max_position_embeddings=g("context_length"),
        bos_token_id=_gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
    )


def _dequantize_gguf(path: str) -> tuple[ModelConfig, StateDict]:
    """The slow path (~3 s for the default model): read and dequantize every tensor to float32."""
    import gguf

    reader = gguf.GGUFReader(path)
    config = gguf_config(reader)
    hf: StateDict = {}
    for t in reader.tensors:
        w = gguf.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if not w.flags.writeable:  # F32 tensors come back as read-only views of the memmap
            w = w.copy()
        if config.arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _unpermute_rope(w, config.num_heads if ".attn_q." in t.name else config.num_kv_heads)
        hf[_gguf_to_hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    return config, convert_hf_state_dict(config, hf)


def load_gguf(path: str, use_cache: bool = True) -> tuple[ModelConfig, StateDict]:
    cache = cache_dir_for(path)
    if use_cache and (hit := _read_cache(cache)) is not None:
        return hit
    config, state = _dequantize_gguf(path)
    if use_cache:
        _write_cache(cache, config, state, source=os.path.abspath(path))
    return config, state


# ---------------------------------------------------------------------------- HF dir / dummy


def load_hf_dir(path: str | os.PathLike) -> tuple[ModelConfig, StateDict]:
    path = Path(path)
    config = ModelConfig.from_json(path / "config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    hf: StateDict = {}
    for f in files:
        hf.update(load_file(f))
    hf = {k: v.float() for k, v in hf.items()}
    return config, convert_hf_state_dict(config, hf)


def random_state_dict(
    config: ModelConfig,
    seed: int = 0,
    std: float = 0.02,
    shard: TensorParallelShard | None = None,
    device: str | torch.device = "cpu",
) -> StateDict:
    """Seeded random weights with our names and shapes; norms are ones. With `shard`, the same
    values cut to that rank's part, each tensor as soon as it is drawn. On a CUDA `device` they are
    drawn there (other values than the CPU's, the same on every GPU): an 8B model in seconds."""
    gen = torch.Generator(device=device).manual_seed(seed)
    c = config
    qkv_out = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim

    out: StateDict = {}

    def put(name: str, whole: torch.Tensor) -> None:
        out[name] = whole if shard is None else shard.take(name, c, lambda: whole)

    def normal(name: str, *shape: int) -> None:
        put(name, torch.empty(shape, device=device).normal_(0.0, std, generator=gen))

    def ones(name: str, n: int) -> None:
        put(name, torch.ones(n, device=device))

    normal("embed_tokens.weight", c.vocab_size, c.hidden_size)
    ones("norm.weight", c.hidden_size)
    if not c.tie_word_embeddings:
        normal("lm_head.weight", c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"layers.{i}."
        ones(p + "input_norm.weight", c.hidden_size)
        ones(p + "post_attn_norm.weight", c.hidden_size)
        normal(p + "attn.qkv_proj.weight", qkv_out, c.hidden_size)
        normal(p + "attn.o_proj.weight", c.hidden_size, c.num_heads * c.head_dim)
        if c.qk_norm:
            ones(p + "attn.q_norm.weight", c.head_dim)
            ones(p + "attn.k_norm.weight", c.head_dim)
        normal(p + "mlp.gate_up_proj.weight", 2 * c.intermediate_size, c.hidden_size)
        normal(p + "mlp.down_proj.weight", c.hidden_size, c.intermediate_size)
    return out


def model_config(source: str | os.PathLike | ModelConfig | None = None) -> ModelConfig:
    """The model's hyper-parameters without loading its weights (a GGUF's header, a config.json)."""
    return _resolve_config(default_model_path() if source is None else source)


def _resolve_config(source: str | os.PathLike | ModelConfig) -> ModelConfig:
    if isinstance(source, ModelConfig):
        return source
    p = Path(source)
    if p.is_dir():
        return ModelConfig.from_json(p / "config.json")
    if p.suffix == ".json":
        return ModelConfig.from_json(p)
    if p.suffix == ".gguf":
        import gguf

        return gguf_config(gguf.GGUFReader(str(p)))
    builtin = BUILTIN_CONFIG_DIR / f"{source}.json"  # e.g. "qwen3-0.6b"
    if builtin.is_file():
        return ModelConfig.from_json(builtin)
    raise FileNotFoundError(f"cannot find a model config for {source!r}")


def load_weights(
    source: str | os.PathLike | ModelConfig | None = None,
    *,
    dummy: bool = False,
    seed: int = 0,
    use_cache: bool = True,
    shard: TensorParallelShard | None = None,
    device: str | torch.device = "cpu",
) -> tuple[ModelConfig, StateDict]:
    """Load (config, float32 state dict with our names).

    source: a .gguf file, a Hugging Face directory, or None for the embedded default model.
    With dummy=True, source may also be a config .json, a shipped config name
    ("qwen3-0.6b", "smollm2-135m") or a ModelConfig, and the weights are random.
    shard: one tensor-parallel rank's part only (engine/distributed/partition.py).
    device: where random weights are drawn (loaded weights come to the CPU).
    """
    if source is None:
        source = default_model_path()
    if shard is not None and shard.size == 1:
        shard = None
    if dummy:
        config = _resolve_config(source)
        if shard is not None:
            shard.check(config)
        return config, random_state_dict(config, seed=seed, shard=shard, device=device)
    if isinstance(source, ModelConfig):
        raise TypeError("a ModelConfig gives random weights only: pass dummy=True")
    p = Path(source)
    if p.is_dir():
        return load_hf_dir(p) if shard is None else _load_hf_dir_shard(p, shard)
    if p.suffix == ".gguf":
        if shard is None:
            return load_gguf(str(p), use_cache=use_cache)
        return _load_gguf_shard(str(p), shard)
    raise ValueError(f"{source!r} is neither a .gguf file nor a Hugging Face model directory")


def ensure_gguf_cache(path: str) -> None:
    """Dequantize a GGUF into its float32 cache once, before ranks read their parts of it."""
    if _read_cache_meta(cache_dir_for(path)) is None:
        load_gguf(path, use_cache=True)


def _load_gguf_shard(path: str, shard: TensorParallelShard) -> tuple[ModelConfig, StateDict]:
    ensure_gguf_cache(path)
    cache = cache_dir_for(path)
    config = ModelConfig.from_json(cache / "config.json")
    shard.check(config)
    with safe_open(cache / _CACHE_WEIGHTS, framework="pt") as f:
        return config, {name: shard.take(name, config, partial(f.get_slice, name)) for name in f.keys()}


def _fused_rows(lazy: Callable[[str], Any], rows: Callable[[str], int], names: List[str]) -> FusedRows:
    return FusedRows([(lazy(n), rows(n)) for n in names])


def _load_hf_dir_shard(path: Path, shard: TensorParallelShard) -> tuple[ModelConfig, StateDict]:
    config = ModelConfig.from_json(path / "config.json")
    shard.check(config)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    handles = [safe_open(f, framework="pt") for f in files]
    where = {name: h for h in handles for name in h.keys()}

    def lazy(hf_name: str):
        return where[hf_name].get_slice(hf_name)

    def rows(hf_name: str) -> int:
        return where[hf_name].get_slice(hf_name).get_shape()[0]

    # the names we would get from convert_hf_state_dict, each with how to read it lazily
    sources: Dict[str, Callable[[], Any]] = {
        "embed_tokens.weight": partial(lazy, "model.embed_tokens.weight"),
        "norm.weight": partial(lazy, "model.norm.weight"),
    }
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = partial(lazy, "lm_head.weight")
    for i in range(config.num_layers):
        hf = f"model.layers.{i}."
        for hf_name, ours in _HF_RENAME.items():
            if hf + hf_name in where:
                sources[f"layers.{i}.{ours}"] = partial(lazy, hf + hf_name)
        for ours, parts in _HF_FUSED.items():
            names = [hf + x for x in parts]
            sources[f"layers.{i}.{ours}"] = partial(_fused_rows, lazy, rows, names)
    return config, {name: shard.take(name, config, get).float() for name, get in sources.items()}


def clear_cache(path: str | os.PathLike) -> None:
    shutil.rmtree(cache_dir_for(path), ignore_errors=True)
