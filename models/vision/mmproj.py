"""llama.cpp's vision projector files (`--mmproj FILE`, as llama-server takes them): a GGUF
of general.architecture "clip" holding a vision encoder and its projector, served next to
a GGUF text model. What an encoder needs from one: its config (from the clip.* metadata,
as an HF config.json's vision part would say it), the image processor's settings, and
its tensors under our parameter names.

Projector types served:
- "idefics3" (SmolVLM, Idefics3: llama.cpp's convert_hf_to_gguf.py --mmproj writes it for
  both), as Idefics3ForConditionalGeneration. llama.cpp feeds such a model one
  image_size x image_size tile a picture; so does zserve with a projector file
  (do_image_splitting off: the tiling of the HF processor is a safetensors checkpoint's).
- "mlp" (LLaVA-1.5: llama.cpp's legacy convert_image_encoder_to_gguf.py), as
  LlavaForConditionalGeneration: the CLIP tower cut after its feature layer (block_count
  blocks, no post-LayerNorm), the class token dropped, the 2-layer projector (mm.0, mm.2),
  CLIP's processing at image_size.
A block's MLP matrices are told apart by shape (the legacy converter names fc1 ffn_down,
the new one ffn_up; llama.cpp's loader swaps them by shape too).
"""

from __future__ import annotations

import torch

# projector_type -> the architecture its encoder is (models/vision ENCODERS)
PROJECTORS = {"idefics3": "Idefics3ForConditionalGeneration",
              "mlp": "LlavaForConditionalGeneration"}


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


def _clip_vision(header) -> dict:
    """The clip.vision.* metadata as an HF vision_config."""
    return {"hidden_size": _meta(header, "clip.vision.embedding_length"),
            "intermediate_size": _meta(header, "clip.vision.feed_forward_length"),
            "num_hidden_layers": _meta(header, "clip.vision.block_count"),
            "num_attention_heads": _meta(header, "clip.vision.attention.head_count"),
            "image_size": _meta(header, "clip.vision.image_size"),
            "patch_size": _meta(header, "clip.vision.patch_size"),
            "layer_norm_eps": _meta(header, "clip.vision.attention.layer_norm_epsilon", 1e-6)}


def vision_config(header, text_config: dict, image_token_id: int) -> dict:
    """The config.json a GGUF text model and this projector stand for together."""
    arch = check(header)
    vision = _clip_vision(header)
    common = {"architectures": [arch], "image_token_id": image_token_id,
              "text_config": text_config,
              "torch_dtype": text_config.get("torch_dtype", "float32")}
    if arch == "LlavaForConditionalGeneration":
        act = "gelu" if header.metadata.get("clip.use_gelu") else "quick_gelu"
        return {**common, "model_type": "llava",
                "vision_config": {**vision, "hidden_act": act},
                # hidden_states[block_count]: the output of the last block the file keeps
                "vision_feature_layer": vision["num_hidden_layers"],
                "vision_feature_select_strategy": "default",
                "projector_hidden_act": "gelu", "multimodal_projector_bias": True}
    return {**common, "model_type": "idefics3",
            "scale_factor": _meta(header, "clip.vision.projector.scale_factor", 2),
            "vision_config": {**vision, "hidden_act": "gelu_pytorch_tanh"}}


def processor_config(header) -> dict:
    """processor_config.json: one image_size picture (module docstring)."""
    size = _meta(header, "clip.vision.image_size")
    patch = _meta(header, "clip.vision.patch_size")
    norm = {"image_mean": list(_meta(header, "clip.vision.image_mean", [0.5] * 3)),
            "image_std": list(_meta(header, "clip.vision.image_std", [0.5] * 3))}
    if check(header) == "LlavaForConditionalGeneration":
        return {"processor_class": "LlavaProcessor", "patch_size": patch,
                "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1,
                "image_processor": {"size": {"shortest_edge": size},
                                    "crop_size": {"height": size, "width": size}, **norm}}
    scale = _meta(header, "clip.vision.projector.scale_factor", 2)
    return {"processor_class": "Idefics3Processor",
            "image_seq_len": (size // patch) ** 2 // scale ** 2,
            "image_processor": {
                "do_image_splitting": False, "size": {"longest_edge": size},
                "max_image_size": {"longest_edge": size}, **norm}}


# where each projector type's encoder keeps its vision tower (models/vision ENCODERS)
TOWERS = {"LlavaForConditionalGeneration": "vision.vision_tower.",
          "Idefics3ForConditionalGeneration": "vision.vision_model."}
BLOCK_PARTS = {"layer_norm1": "ln1", "layer_norm2": "ln2", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.out_proj": "attn_out"}


def tensor_names(arch: str, layers: int) -> dict[str, str]:
    """Our parameter -> the projector file's tensor (llama.cpp's names), but for the blocks'
    MLP matrices (`mlp_names`)."""
    tower = TOWERS[arch]
    if arch == "LlavaForConditionalGeneration":
        ours = {f"{tower}embeddings.class_embedding": "v.class_embd",
                f"{tower}embeddings.patch_embedding.weight": "v.patch_embd.weight",
                f"{tower}embeddings.position_embedding.weight": "v.position_embd.weight",
                f"{tower}pre_layrnorm.weight": "v.pre_ln.weight",
                f"{tower}pre_layrnorm.bias": "v.pre_ln.bias",
                **{f"vision.multi_modal_projector.linear_{i}.{kind}": f"mm.{2 * i - 2}.{kind}"
                   for i in (1, 2) for kind in ("weight", "bias")}}
    else:
        ours = {f"{tower}embeddings.patch_embedding.weight": "v.patch_embd.weight",
                f"{tower}embeddings.patch_embedding.bias": "v.patch_embd.bias",
                f"{tower}embeddings.position_embedding.weight": "v.position_embd.weight",
                f"{tower}post_layernorm.weight": "v.post_ln.weight",
                f"{tower}post_layernorm.bias": "v.post_ln.bias",
                "vision.connector.modality_projection.proj.weight": "mm.model.fc.weight"}
    for i in range(layers):
        for part, theirs in BLOCK_PARTS.items():
            for kind in ("weight", "bias"):
                ours[f"{tower}encoder.layers.{i}.{part}.{kind}"] = f"v.blk.{i}.{theirs}.{kind}"
    return ours


def mlp_names(header, arch: str, layers: int) -> dict[str, str]:
    """Each block's fc1 and fc2 (weight, bias) -> the file's ffn_up / ffn_down, by shape:
    fc1's weight maps the width to the wider hidden layer."""
    tower = TOWERS[arch]
    width = _meta(header, "clip.vision.embedding_length")
    out = {}
    for i in range(layers):
        up = header.tensors.get(f"v.blk.{i}.ffn_up.weight")
        first = "ffn_up" if up is not None and up.shape[-1] == width else "ffn_down"
        second = "ffn_down" if first == "ffn_up" else "ffn_up"
        for ours, theirs in (("fc1", first), ("fc2", second)):
            for kind in ("weight", "bias"):
                out[f"{tower}encoder.layers.{i}.mlp.{ours}.{kind}"] = f"v.blk.{i}.{theirs}.{kind}"
    return out


def load(header, params: dict[str, torch.Tensor]) -> None:
    """Every `vision.*` parameter from the projector file (dequantized, cast to the
    parameter's dtype and device). ValueError for a tensor missing or misshapen, or one
    of ours left without a tensor. CLIP's post-LayerNorm, which LLaVA never applies and
    the legacy converter leaves out, is set to the identity."""
    arch = check(header)
    layers = _meta(header, "clip.vision.block_count")
    names = {**tensor_names(arch, layers), **mlp_names(header, arch, layers)}
    wanted = {k for k in params if k.startswith("vision.")}
    for unused in [k for k in wanted - set(names) if ".post_layernorm." in k]:
        params[unused].fill_(1.0 if unused.endswith("weight") else 0.0)
        wanted.discard(unused)
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
