"""The scheduler process: continuous batching, the KV pool, the model forward and sampling."""
