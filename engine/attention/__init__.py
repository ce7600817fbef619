from engine.attention.base import AttentionBackend, AttentionBatch
from engine.attention.torch_native import TorchNativeBackend

__all__ = ["AttentionBackend", "AttentionBatch", "TorchNativeBackend"]
