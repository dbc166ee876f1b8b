"""Model definitions for the scheduler: Llama-family decoders in plain torch.

    config = ModelConfig.from_path(path)           # parsed, checked config.json (or GGUF metadata)
    model = load_model(path, torch.bfloat16, "cuda")
    hidden = model(input_ids, positions, attn)     # flat ragged batch of N tokens
    logits = model.compute_logits(hidden[last])    # float32 [M, vocab]

`path` is an HF directory, a .gguf file, a directory holding one .gguf, or the sidecar
directory `gguf.materialize(path)` writes for a GGUF (config + tokenizer files, so that the
other processes can read a GGUF model as an HF directory); see gguf.py.
`attn(layer_id, q, k, v)` owns the KV cache and the attention math; see llama.py.
"""

from .config import ModelConfig
from .loader import load_model

__all__ = ["ModelConfig", "load_model"]
