"""kvledger's tensor CacheManager (CPU or CUDA, same code), held to the `reference` model.

Exposes the same public names and signatures as `reference`, with tensors where it has lists.
"""

from kvledger.reference.admission_policy import AdmissionPolicy
from kvledger.reference.cache_manager import IntegrityError

from .admission import DecodeManager, PrefillAdder
from .cache_manager import CacheManager, create_prefix_cache
from .preemption import Preemptor
from .prefix_cache import CacheHandle, InsertResult, MatchResult, NaivePrefixCache, SizeInfo
from .radix_cache import RadixPrefixCache
from .requests import ChunkedReq, PendingReq, Req, SamplingParams
from .table import TableManager, make_page_table

__all__ = [
    "AdmissionPolicy",
    "Preemptor",
    "CacheHandle",
    "CacheManager",
    "ChunkedReq",
    "DecodeManager",
    "InsertResult",
    "IntegrityError",
    "MatchResult",
    "NaivePrefixCache",
    "PendingReq",
    "PrefillAdder",
    "RadixPrefixCache",
    "Req",
    "SamplingParams",
    "SizeInfo",
    "TableManager",
    "create_prefix_cache",
    "make_page_table",
]
