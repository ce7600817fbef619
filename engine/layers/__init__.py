from kvledger.engine.layers.embedding import Embedding, LMHead
from kvledger.engine.layers.linear import Linear
from kvledger.engine.layers.mlp import GatedMLP
from kvledger.engine.layers.norm import RMSNorm
from kvledger.engine.layers.rotary import RotaryEmbedding

__all__ = ["Embedding", "GatedMLP", "LMHead", "Linear", "RMSNorm", "RotaryEmbedding"]
