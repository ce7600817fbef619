"""Model hyper-parameters, read from a Hugging Face style config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHS = ("llama", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported arch {self.arch!r}, expected one of {SUPPORTED_ARCHS}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        arch = cfg.get("model_type", "llama")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise NotImplementedError("attention/MLP biases are not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {cfg['hidden_act']!r} is not supported")
        # transformers 5 moved rope settings into "rope_parameters"; 4.x used rope_theta/rope_scaling.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise NotImplementedError(f"rope scaling {rope!r} is not supported")
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf_config(json.loads(Path(path).read_text()))

    def to_hf_config(self) -> dict[str, Any]:
        """Inverse of from_hf_config (enough for transformers to rebuild the model)."""
        d = asdict(self)
        eos = list(d.pop("eos_token_ids"))
        return {
            "architectures": ["LlamaForCausalLM" if self.arch == "llama" else "Qwen3ForCausalLM"],
            "model_type": d.pop("arch"),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
        }


BUILTIN_CONFIG_DIR = Path(__file__).parent / "configs"


def builtin_config(name: str) -> ModelConfig:
    """Load one of the shipped configs by stem, e.g. "qwen3-0.6b" or "smollm2-135m"."""
    return ModelConfig.from_json(BUILTIN_CONFIG_DIR / f"{name}.json")
