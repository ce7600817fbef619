"""The runtime: the engine that steps the model over the cache scheduler, its scheduler, CUDA
graphs, sampling and `LLM`."""
