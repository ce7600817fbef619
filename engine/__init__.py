"""The serving engine on `fast`: the cache-side scheduler and its trace format (`ledger/`), the
model, attention, the runtime that steps them, the HTTP server and tensor parallelism."""
