"""load_model: a Hugging Face checkpoint directory or a GGUF file -> CausalLM on a device,
in a dtype.

The module is built on `meta` (no memory, no random init); each parameter is then allocated
once on the target device and every checkpoint tensor is copied straight into its rows of
it, so fusing q/k/v and gate/up costs no extra copy and peak host memory stays one tensor.
Any checkpoint tensor we cannot place, or parameter left unfilled, is an error listing them.
A GGUF file (or a directory holding one, or its sidecar from gguf.materialize) is read by
gguf.py: config from its metadata, each tensor dequantized into the same parameters.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from torch import nn

from .config import ModelConfig
from .llama import CausalLM
from scheduler_proc import kernels
from .cpu_linear import CpuLinear
from .packed import PackedLinear, can_pack

# Our fused projection -> its checkpoint parts, stacked in this order along the output dim.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def load_model(model_path: str | Path, dtype: torch.dtype, device: str | torch.device,
               pack: bool | None = None) -> CausalLM:
    """model_path: an HF directory (config.json + *.safetensors), a .gguf file, a directory
    holding exactly one .gguf (and no config.json), or a GGUF sidecar directory.
    pack: lay the linear weights out for a CPU kernel (cpu_linear.py, else oneDNN's:
    packed.py); None: wherever one is available; False: keep plain nn.Linear."""
    from . import gguf

    gguf_path = gguf.find_gguf(model_path)
    header = gguf.read_header(gguf_path) if gguf_path is not None else None
    if header is not None:
        config = ModelConfig.from_dict(gguf.config_dict(header), gguf.generation_dict(header))
    else:
        config = ModelConfig.from_dir(model_path)
    with torch.device("meta"), _skip_init():
        model = CausalLM(config)
    params = {name: torch.empty(p.shape, dtype=dtype, device=device)
              for name, p in model.named_parameters()}
    rope_freqs = None
    if header is not None:
        rope_freqs = gguf.load_weights(header, config, params)
    else:
        _load_safetensors(Path(model_path), config, params)

    model.load_state_dict(params, strict=True, assign=True)
    if rope_freqs is not None:          # a GGUF's Llama 3 rope scaling, as llama.cpp applies it
        model.cos_sin = gguf.rope_cos_sin(config, rope_freqs)
    model.cos_sin = model.cos_sin.to(device=device, dtype=dtype)  # HF casts cos/sin to the dtype too
    model.requires_grad_(False).eval()
    layer = _cpu_linear_class(torch.device(device), dtype) if pack is not False else None
    if pack and layer is None:
        raise ValueError(f"no packed CPU linear layer for {dtype} on {device}")
    if layer is not None:
        if model.lm_head is None:           # tied: the head gets its own (packed) copy
            model.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False,
                                      device=device, dtype=dtype)
            model.lm_head.weight.data = model.embed_tokens.weight.data
        _replace_linears(model, layer)
    return model


@contextlib.contextmanager
def _skip_init():
    """No random init for modules built on `meta`: every value is loaded afterwards, and
    nn.Embedding's normal_ on meta imports torch._dynamo (seconds on a busy machine)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "zeros_", "ones_")
    saved = {name: getattr(nn.init, name) for name in names}
    for name in names:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _load_safetensors(model_dir: Path, config: ModelConfig,
                      params: dict[str, torch.Tensor]) -> None:
    """Copy every tensor of the directory's safetensors files into its rows of params."""
    targets = _checkpoint_targets(config, params)
    filled, unexpected = set(), []
    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith("rotary_emb.inv_freq"):        # recomputed, not loaded
                    continue
                if key == "lm_head.weight" and config.tie_word_embeddings:
                    continue                                    # a redundant copy of the embedding
                if key not in targets:
                    unexpected.append(key)
                    continue
                name, rows = targets[key]
                dst, src = params[name][rows], f.get_slice(key)
                if tuple(dst.shape) != tuple(src.get_shape()):
                    raise ValueError(f"{path.name}: {key} has shape {tuple(src.get_shape())}, "
                                     f"expected {tuple(dst.shape)} for {config.architecture}")
                dst.copy_(f.get_tensor(key))                    # casts to dtype, moves to device
                filled.add(key)
    missing = sorted(targets.keys() - filled)
    if missing or unexpected:
        raise ValueError(f"checkpoint {model_dir} does not match {config.architecture}: "
                         f"missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                         f"unexpected tensors {sorted(unexpected)[:8]}"
                         f"{'...' if len(unexpected) > 8 else ''}")


def _cpu_linear_class(device: torch.device, dtype: torch.dtype) -> type[nn.Module] | None:
    """The fastest linear layer for this device and dtype: ours, else oneDNN's, else None."""
    if kernels.available(device, dtype):
        return CpuLinear
    return PackedLinear if can_pack(device, dtype) else None


def _replace_linears(model: nn.Module, layer: type[nn.Module]) -> None:
    """Replace every nn.Linear below `model` with layer(weight, bias), in place."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, layer(child.weight, child.bias))
        else:
            _replace_linears(child, layer)


def _checkpoint_targets(config: ModelConfig,
                        params: dict[str, torch.Tensor]) -> dict[str, tuple[str, slice]]:
    """Checkpoint tensor name -> (our parameter name, the rows of it that tensor fills)."""
    part_rows = {"q_proj": config.q_size, "k_proj": config.kv_size, "v_proj": config.kv_size,
                 "gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
    targets = {}
    for name in params:
        module, kind = name.rsplit(".", 1)                      # kind: "weight" | "bias"
        hf_module = module if module == "lm_head" else f"model.{module}"
        fused = next((f for f in _FUSED if module.endswith(f)), None)
        if fused is None:
            targets[f"{hf_module}.{kind}"] = (name, slice(None))
            continue
        prefix, start = hf_module[: -len(fused)], 0             # "model.layers.3."
        for part in _FUSED[fused]:
            n = part_rows[part.rsplit(".", 1)[1]]
            targets[f"{prefix}{part}.{kind}"] = (name, slice(start, start + n))
            start += n
    return targets


def _safetensors_files(model_dir: Path) -> list[Path]:
    """The shards named by model.safetensors.index.json, else model.safetensors, else all
    *.safetensors (a directory may also hold e.g. Mistral's consolidated.safetensors)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    if (model_dir / "model.safetensors").exists():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files
