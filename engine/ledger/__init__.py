"""The verified ledger: the cache-side scheduler, its typed operations and trace format, the
judge (invariants.py), and the observers that record and verify the engine's operations."""
