"""kvledger's reference model of KV page ownership: pure Python, no torch, meant to be read.

Every page of the pool is free, owned by one live request, or held by one prefix-cache node.
`fast` exposes the same names and signatures on tensors and is checked against this model.
"""

from .admission import DecodeManager, PrefillAdder
from .admission_policy import AdmissionPolicy
from .cache_manager import CacheManager, IntegrityError, create_prefix_cache
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
