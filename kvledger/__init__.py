"""kvledger: a verified KV-cache manager for LLM serving, and the serving engine it drives.

Subpackages (see ARCHITECTURE.md): `reference` (the pure-Python model of page ownership),
`fast` (the tensor CacheManager), `engine` (model, scheduler, server), `properties` (the lockstep
harness), `tools` (fuzz, minimize, replay, show, zoo, coverage) and `bench` (benchmarks).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvledger")
except PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0+unknown"
