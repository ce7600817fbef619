from engine.layers.embedding import Embedding, LMHead
from engine.layers.linear import Linear
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding

__all__ = ["Embedding", "GatedMLP", "LMHead", "Linear", "RMSNorm", "RotaryEmbedding"]
