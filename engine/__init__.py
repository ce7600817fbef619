"""Model side of the kvledger serving engine: weights, tokenizer, model, KV pool, attention."""
