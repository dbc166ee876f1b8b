"""Reproducible tiny Hugging Face checkpoints (tokenizer + random-weight decoders) that the
tests, the demo server and the benchmarks load like any real model directory."""
