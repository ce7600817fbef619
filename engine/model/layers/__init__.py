from kvledger.engine.model.layers.embedding import Embedding, LMHead
from kvledger.engine.model.layers.linear import Linear
from kvledger.engine.model.layers.mlp import GatedMLP
from kvledger.engine.model.layers.norm import RMSNorm
from kvledger.engine.model.layers.rotary import RotaryEmbedding

__all__ = ["Embedding", "GatedMLP", "LMHead", "Linear", "RMSNorm", "RotaryEmbedding"]
