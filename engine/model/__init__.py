"""The model: configuration, weights, tokenizer, layers, fused elementwise kernels and the paged KV pool."""
