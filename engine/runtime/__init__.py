"""The runtime: the engine that steps the model over the ledger, its scheduler, CUDA graphs, sampling and `LLM`."""
