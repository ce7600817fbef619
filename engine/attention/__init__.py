from kvledger.engine.attention.base import AttentionBackend, AttentionBatch
from kvledger.engine.attention.torch_native import TorchNativeBackend

__all__ = ["AttentionBackend", "AttentionBatch", "TorchNativeBackend"]
