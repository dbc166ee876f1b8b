"""llama.cpp's vision projector files (`--mmproj FILE`, as llama-server takes them): a GGUF
of general.architecture "clip" holding a vision encoder and its projector, served next to
a GGUF text model. What an encoder needs from one: its config (from the clip.* metadata,
as an HF config.json's vision part would say it), the image processor's settings, and
its tensors under our parameter names.

Projector types served: "idefics3" (SmolVLM, Idefics3: llama.cpp's convert_hf_to_gguf.py
--mmproj writes it for both), as Idefics3ForConditionalGeneration. llama.cpp feeds such a
model one image_size x image_size tile a picture; so does zserve with a projector file
(do_image_splitting off: the tiling of the HF processor is a safetensors checkpoint's).
"""

from __future__ import annotations

import torch

# projector_type -> the architecture its encoder is (models/vision ENCODERS)
PROJECTORS = {"idefics3": "Idefics3ForConditionalGeneration"}


def _meta(header, key: str, default=KeyError):
    value = header.metadata.get(key, default)
    if value is KeyError:
        raise ValueError(f"{header.path.name}: no {key} in this projector file")
    return value


def check(header) -> str:
    """The architecture a projector file serves as; ValueError for one zserve cannot."""
    if header.metadata.get("general.architecture") != "clip":
        raise ValueError(f"{header.path.name} is not a vision projector file "
                         f"(general.architecture {header.metadata.get('general.architecture')!r}"
                         f", not 'clip')")
    kind = _meta(header, "clip.projector_type")
    if kind not in PROJECTORS:
        raise ValueError(f"{header.path.name}: projector type {kind!r} is not served; zserve "
                         f"serves {', '.join(sorted(PROJECTORS))}")
    return PROJECTORS[kind]


def vision_config(header, text_config: dict, image_token_id: int) -> dict:
    """The config.json a GGUF text model and this projector stand for together."""
    arch = check(header)
    vision = {"hidden_size": _meta(header, "clip.vision.embedding_length"),
              "intermediate_size": _meta(header, "clip.vision.feed_forward_length"),
              "num_hidden_layers": _meta(header, "clip.vision.block_count"),
              "num_attention_heads": _meta(header, "clip.vision.attention.head_count"),
              "image_size": _meta(header, "clip.vision.image_size"),
              "patch_size": _meta(header, "clip.vision.patch_size"),
              "layer_norm_eps": _meta(header, "clip.vision.attention.layer_norm_epsilon", 1e-6),
              "hidden_act": "gelu_pytorch_tanh"}
    return {"architectures": [arch], "model_type": "idefics3",
            "image_token_id": image_token_id,
            "scale_factor": _meta(header, "clip.vision.projector.scale_factor", 2),
            "vision_config": vision, "text_config": text_config,
            "torch_dtype": text_config.get("torch_dtype", "float32")}


def processor_config(header) -> dict:
    """processor_config.json: one tile of image_size a picture (module docstring)."""
    size = _meta(header, "clip.vision.image_size")
    patch = _meta(header, "clip.vision.patch_size")
    scale = _meta(header, "clip.vision.projector.scale_factor", 2)
    return {"processor_class": "Idefics3Processor",
            "image_seq_len": (size // patch) ** 2 // scale ** 2,
            "image_processor": {
                "do_image_splitting": False, "size": {"longest_edge": size},
                "max_image_size": {"longest_edge": size},
                "image_mean": list(_meta(header, "clip.vision.image_mean", [0.5] * 3)),
                "image_std": list(_meta(header, "clip.vision.image_std", [0.5] * 3))}}


def tensor_names(layers: int) -> dict[str, str]:
    """Our parameter -> the projector file's tensor (llama.cpp's names), idefics3."""
    ours = {"vision.vision_model.embeddings.patch_embedding.weight": "v.patch_embd.weight",
            "vision.vision_model.embeddings.patch_embedding.bias": "v.patch_embd.bias",
            "vision.vision_model.embeddings.position_embedding.weight": "v.position_embd.weight",
            "vision.vision_model.post_layernorm.weight": "v.post_ln.weight",
            "vision.vision_model.post_layernorm.bias": "v.post_ln.bias",
            "vision.connector.modality_projection.proj.weight": "mm.model.fc.weight"}
    parts = {"layer_norm1": "ln1", "layer_norm2": "ln2", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.out_proj": "attn_out", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}
    for i in range(layers):
        for part, theirs in parts.items():
            for kind in ("weight", "bias"):
                ours[f"vision.vision_model.encoder.layers.{i}.{part}.{kind}"] = \
                    f"v.blk.{i}.{theirs}.{kind}"
    return ours


def load(header, params: dict[str, torch.Tensor]) -> None:
    """Every `vision.*` parameter from the projector file (dequantized, cast to the
    parameter's dtype and device). ValueError for a tensor missing or misshapen, or one
    of ours left without a tensor."""
    check(header)
    names = tensor_names(_meta(header, "clip.vision.block_count"))
    wanted = {k for k in params if k.startswith("vision.")}
    if wanted != set(names):
        raise ValueError(f"{header.path.name}: the encoder's parameters "
                         f"{sorted(wanted ^ set(names))[:4]} have no tensor here")
    for ours, theirs in names.items():
        info = header.tensors.get(theirs)
        if info is None:
            raise ValueError(f"{header.path.name}: no tensor {theirs}")
        if tuple(info.shape) != tuple(params[ours].shape):
            raise ValueError(f"{header.path.name}: {theirs} has shape {info.shape}, expected "
                             f"{tuple(params[ours].shape)}")
        values = header.dequantize(info)
        params[ours].copy_(torch.from_numpy(values if values.flags.writeable
                                            else values.copy()))
