"""The model stack, used by the scheduler and its tensor-parallel ranks: Llama-family
decoders in plain torch (llama.py), their configs (config.py), weights from safetensors and
GGUF (loader.py, gguf.py), quantized layouts (quant_linear.py, packed.py, cpu_linear.py),
the C kernels and the rule that picks them (kernels/), and the collectives a sharded model
calls (distributed.py, tp.py). It imports nothing from any *_proc package.

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
from .loader import describe_weights, load_model

__all__ = ["ModelConfig", "describe_weights", "load_model"]
