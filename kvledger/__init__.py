"""kvledger: a verified KV-cache manager (reference model, tensor CacheManager, properties)."""
