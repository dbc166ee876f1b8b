"""ModelConfig: the few numbers of a Hugging Face `config.json` that the model file needs.

Parsed once, checked once: an architecture or feature we do not implement is a ValueError here,
at startup, rather than wrong tokens later. Both config dialects are read: transformers 5
(`rope_parameters: {"rope_type", "rope_theta", ...}`, `dtype`) and older ones (top-level
`rope_theta` + `rope_scaling`, `torch_dtype`). A GGUF file (or a directory holding one) has no
config.json: `from_path` builds the same dict from its metadata (gguf.py); a GGUF sidecar
directory (gguf.materialize) has a config.json and reads like any HF directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from wire.model_path import (decoder_config, expert_intermediate_size, num_experts,
                             sparse_layers, vision_architecture)

from .rope import REQUIRED, ROPE_ALIASES, ROPE_TYPES

# HF architecture name -> family. Everything in the model file keys off the family.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "SmolLM3ForCausalLM": "smollm3",    # Llama with no RoPE on every no_rope_layer_interval-th
    "Phi3ForCausalLM": "phi3",          # fused checkpoint qkv / gate_up, partial rotary, longrope
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",  # Qwen3 attention, mixture-of-experts MLPs (moe.py)
    "MixtralForCausalLM": "mixtral",    # Mistral attention, mixture-of-experts MLPs (moe.py)
}
# Gemma's layer (models/gemma.py): (1 + weight) RMSNorms before and after attention and MLP,
# GeGLU, embeddings scaled by sqrt(hidden), local (sliding) and global layers.
GEMMA_FAMILIES = ("gemma2", "gemma3")
# config.json's hidden_act -> the MLP's gate activation (ops.act_and_mul).
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What one layer's attention computes beyond softmax(q k^T) v (the attention backend
    applies it: scheduler_proc/attention.py)."""

    scale: float | None             # on q k^T; None: head_dim ** -0.5 (SDPA's default)
    window: int | None = None       # attend only positions > p - window (None: all <= p)
    softcap: float | None = None    # scores -> softcap * tanh(scores / softcap)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str               # e.g. "Qwen3ForCausalLM"
    family: str                     # a value of ARCHITECTURES: "llama", "qwen3_moe", ...
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int                   # explicit in Qwen3/Mistral configs, may differ from hidden/heads
    intermediate_size: int          # a dense MLP's (Mixtral: each expert's, as its config says)
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None       # None for plain RoPE; else its parameters (rope.py)
    max_position_embeddings: int
    qkv_bias: bool                  # qwen2: always; llama/qwen3: attention_bias; mistral: never
    o_bias: bool                    # llama/qwen3: attention_bias; qwen2/mistral: never
    mlp_bias: bool                  # llama only (`mlp_bias`)
    qk_norm: bool                   # qwen3(_moe): per-head RMSNorm on q and k before RoPE
    tie_word_embeddings: bool
    # Sliding-window attention: a query at position p attends positions > p - sliding_window
    # on the layers `layer_windows` marks (transformers' sliding_window_overlay); every layer
    # when layer_windows is None. None: full attention everywhere.
    sliding_window: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    dtype: torch.dtype | None = None  # the checkpoint's dtype, informational
    # A vision-language model (wire.model_path.VISION_ARCHITECTURES): its architecture and
    # whole config.json, which its encoder reads (models/vision/); None for a text model.
    # The fields above are then its text decoder's.
    vision_architecture: str | None = None
    vision_config: dict | None = None
    # Qwen2-VL's multimodal RoPE: how many of the head's d/2 frequencies take the temporal,
    # height and width positions (text tokens have all three equal: plain RoPE).
    mrope_section: tuple[int, ...] | None = None
    # SmolLM3: 1 for a layer that rotates q and k, 0 for one that does not (NoPE); None:
    # every layer does.
    rope_layers: tuple[int, ...] | None = None
    # Per layer, 1 for a sliding-window (local) layer and 0 for a full (global) one: Gemma's
    # and windowed Qwen's layer_types. None: every layer the same (windowed iff
    # sliding_window is set).
    layer_windows: tuple[int, ...] | None = None
    hidden_act: str = "silu"                  # a value of ACTIVATIONS
    attn_scale: float | None = None           # softmax scale; None: head_dim ** -0.5
    attn_softcap: float | None = None         # Gemma 2: scores = cap * tanh(scores / cap)
    final_softcap: float | None = None        # Gemma 2: the same on the logits
    local_rope_theta: float | None = None     # Gemma 3's sliding layers' RoPE base
    # The leading dims of each head that RoPE rotates (from_dict always sets it): head_dim,
    # or Phi-3's partial_rotary_factor of it; the rest pass through unrotated.
    rotary_dim: int | None = None

    # Mixtures of experts (Qwen3-MoE, Mixtral; models/moe.py). Invariant: num_experts > 0
    # exactly when moe_layers is not None (a config whose layers are all dense is a dense
    # model: 0 experts). moe_layers: 1 for a layer whose MLP is the sparse one, 0 for a
    # dense MLP of intermediate_size (Qwen3-MoE's mlp_only_layers, decoder_sparse_step);
    # None: all dense.
    # The router takes the top experts_per_token of the softmax over the experts and
    # renormalizes their probabilities to sum to 1 if norm_topk_prob (Mixtral always);
    # routing_weights_fp32: the weights multiply the experts' outputs in float32 (Mixtral)
    # rather than cast to the model's dtype first (Qwen3-MoE), as transformers does.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    routing_weights_fp32: bool = False
    moe_layers: tuple[int, ...] | None = None

    @property
    def gemma(self) -> bool:
        return self.family in GEMMA_FAMILIES

    def attention_layers(self) -> tuple[LayerAttention, ...]:
        """Each layer's attention: its softmax scale, window and score cap."""
        scale = self.attn_scale
        windows = self.layer_windows or (1,) * self.num_layers
        return tuple(LayerAttention(scale, self.sliding_window if w else None,
                                    self.attn_softcap) for w in windows)

    def sparse(self, layer_id: int) -> bool:
        """Does layer `layer_id` have the mixture-of-experts MLP (else a dense one)?"""
        return self.moe_layers is not None and bool(self.moe_layers[layer_id])

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        """From an HF directory (config.json), a GGUF sidecar directory (gguf.materialize:
        also has one), a .gguf file, or a directory holding exactly one .gguf and no
        config.json (the config is then built from the file's metadata)."""
        path = Path(path)
        if (path / "config.json").is_file():
            cfg = json.loads((path / "config.json").read_text())
            gen_path = path / "generation_config.json"
            gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
            return cls.from_dict(cfg, gen)
        from . import gguf
        if (gguf_path := gguf.find_gguf(path)) is not None:
            header = gguf.read_header(gguf_path)
            return cls.from_dict(gguf.config_dict(header), gguf.generation_dict(header))
        if not path.exists():
            raise FileNotFoundError(f"model path {path} does not exist")
        raise FileNotFoundError(f"{path} has neither a config.json nor a .gguf file")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """The same as from_path (the older name; it takes GGUF paths too)."""
        return cls.from_path(model_dir)

    @classmethod
    def from_dict(cls, cfg: dict, generation: dict | None = None) -> ModelConfig:
        full, vision = cfg, vision_architecture(cfg)
        cfg = decoder_config(cfg)
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}: "
                f"zserve supports {sorted(ARCHITECTURES)}")
        family = ARCHITECTURES[arch]
        gemma = family in GEMMA_FAMILIES
        # Gemma's configs name it hidden_activation (older ones hidden_act too).
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}: zserve supports "
                             f"{sorted(ACTIVATIONS)}")
        # Layers of two kinds, local (windowed) and global: Gemma's, and Qwen's with
        # use_sliding_window (its layers from max_window_layers on are local).
        per_layer = gemma or bool(cfg.get("use_sliding_window"))
        if cfg.get("use_bidirectional_attention"):     # EmbeddingGemma: not a decoder
            raise ValueError(f"{arch} with use_bidirectional_attention=true is not supported")

        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        mrope = (cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}).get("mrope_section")
        rope_theta, rope_scaling, local_theta = _parse_rope(cfg, family)
        rotary_dim = _rotary_dim(cfg, head_dim) if family == "phi3" else head_dim
        _check_factors(rope_scaling, rotary_dim)
        attention_bias = bool(cfg.get("attention_bias", False))
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype")
        return cls(
            architecture=arch,
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            qkv_bias={"qwen2": True, "mistral": False, "mixtral": False}.get(family,
                                                                            attention_bias),
            o_bias=family in ("llama", "qwen3", "qwen3_moe", "smollm3") and attention_bias,
            mlp_bias=family in ("llama", "smollm3") and bool(cfg.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            sliding_window=(cfg.get("sliding_window")
                            if family in ("mistral", "mixtral", "phi3") or per_layer
                            else None),
            eos_token_ids=_eos_ids(cfg, generation or {}),
            bos_token_id=cfg.get("bos_token_id"),
            dtype=_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None,
            vision_architecture=vision,
            vision_config=full if vision is not None else None,
            mrope_section=tuple(mrope) if mrope and vision is not None else None,
            rope_layers=_rope_layers(cfg) if family == "smollm3" else None,
            layer_windows=_layer_windows(cfg, family) if per_layer else None,
            hidden_act=ACTIVATIONS[act],
            attn_scale=(float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma
                        else None),
            attn_softcap=_positive(cfg.get("attn_logit_softcapping")) if gemma else None,
            final_softcap=_positive(cfg.get("final_logit_softcapping")) if gemma else None,
            local_rope_theta=local_theta if family == "gemma3" else None,
            rotary_dim=rotary_dim,
            **_experts(cfg, family),
        )


def _parse_rope(cfg: dict, family: str) -> tuple[float, dict | None, float | None]:
    """(rope_theta, scaling params or None, the local layers' theta or None) from either
    config dialect, with the keys its type needs (rope.REQUIRED) checked here. Gemma 3's
    rope_parameters hold one set per layer type ({"full_attention": ...,
    "sliding_attention": ...}); its older configs say rope_theta and rope_local_base_freq."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    local = cfg.get("rope_local_base_freq")
    if "full_attention" in params or "sliding_attention" in params:
        local_params = params.get("sliding_attention") or {}
        local = local_params.get("rope_theta", local)
        if (local_params.get("rope_type") or "default") != "default":
            raise ValueError(f"unsupported rope type {local_params['rope_type']!r} on the "
                             f"sliding-window layers: zserve supports 'default' there")
        params = dict(params.get("full_attention") or {})
    params.pop("mrope_section", None)           # Qwen2-VL's sections: ModelConfig keeps them
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    rope_type = ROPE_ALIASES.get(rope_type, rope_type)
    if family == "phi3" and rope_type == "yarn":    # transformers' Phi3Config reads it so
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}: zserve supports {ROPE_TYPES}")
    local = None if local is None else float(local)
    if rope_type == "default":
        return float(theta), None, local
    params["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn", "longrope"):
        # transformers: a top-level original_max_position_embeddings wins (Phi-3 keeps it
        # there, and Phi3Config's default is 4096); else max_position_embeddings
        top = cfg.get("original_max_position_embeddings", 4096 if family == "phi3" else None)
        if top is not None:
            params["original_max_position_embeddings"] = top
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    missing = [k for k in REQUIRED[rope_type] if params.get(k) is None]
    if missing:
        raise ValueError(f"rope type {rope_type!r} needs {', '.join(missing)} in the "
                         f"config's rope parameters")
    return float(theta), params, local


def _layer_windows(cfg: dict, family: str) -> tuple[int, ...]:
    """layer_types as 1 (sliding_attention) / 0 (full_attention), or the pattern
    transformers derives without them: Gemma 2 alternates (local first), Gemma 3 has one
    global layer in every sliding_window_pattern (6), Qwen's layers from max_window_layers
    (28) on are local."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None and family not in GEMMA_FAMILIES:
        return tuple(int(i >= cfg.get("max_window_layers", 28)) for i in range(n))
    if types is None:
        every = 2 if family == "gemma2" else cfg.get("sliding_window_pattern", 6)
        return tuple(int((i + 1) % every != 0) for i in range(n))
    if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must name sliding_attention or full_attention for "
                         f"each of the {n} layers, not {types!r}")
    return tuple(int(t == "sliding_attention") for t in types)


def _positive(value) -> float | None:
    """A soft-capping value: None or 0 (transformers' 'off') -> None."""
    return float(value) if value else None


def _rotary_dim(cfg: dict, head_dim: int) -> int:
    """Phi-3's rotated dims per head: partial_rotary_factor (in rope_parameters, else at the
    top level, else 1) of head_dim, as transformers rounds it."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    dim = int(head_dim * factor)
    if not 0 < dim <= head_dim or dim % 2:
        raise ValueError(f"partial_rotary_factor {factor} gives {dim} rotated dims of a head "
                         f"of {head_dim}: zserve needs an even number, at least 2")
    return dim


def _check_factors(scaling: dict | None, rotary_dim: int) -> None:
    """longrope's short and long factors: one per rotated pair of dims."""
    if scaling is None or scaling["rope_type"] != "longrope":
        return
    for key in ("short_factor", "long_factor"):
        if len(scaling[key]) != rotary_dim // 2:
            raise ValueError(f"rope {key} has {len(scaling[key])} entries, expected "
                             f"{rotary_dim // 2} (half the {rotary_dim} rotated dims)")


def _rope_layers(cfg: dict) -> tuple[int, ...]:
    """SmolLM3's no_rope_layers (1: RoPE; 0: none), or the pattern its interval makes:
    every no_rope_layer_interval-th layer without (transformers' default)."""
    layers = cfg.get("no_rope_layers")
    if layers is None:
        every = cfg.get("no_rope_layer_interval", 4)
        layers = [int((i + 1) % every != 0) for i in range(cfg["num_hidden_layers"])]
    if len(layers) != cfg["num_hidden_layers"]:
        raise ValueError(f"no_rope_layers has {len(layers)} entries for "
                         f"{cfg['num_hidden_layers']} layers")
    return tuple(int(bool(x)) for x in layers)


def _experts(cfg: dict, family: str) -> dict:
    """The mixture-of-experts fields of ModelConfig (none for a dense model), checked. Which
    layers are sparse, and the defaults, are wire.model_path's (the launcher counts the
    parameters by them too)."""
    layers = sparse_layers(cfg)
    if not any(layers):
        return {}
    n = num_experts(cfg)
    k = cfg.get("num_experts_per_tok", 2 if family == "mixtral" else 8)  # transformers'
    if not 0 < k <= n:
        raise ValueError(f"num_experts_per_tok {k} must be in [1, {n}] (the number of experts)")
    return dict(num_experts=n, experts_per_token=k,
                moe_intermediate_size=expert_intermediate_size(cfg),
                norm_topk_prob=family == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
                routing_weights_fp32=family == "mixtral", moe_layers=tuple(layers))


def _eos_ids(cfg: dict, generation: dict) -> list[int]:
    """Union of config.json's and generation_config.json's eos_token_id (each int or list)."""
    ids: list[int] = []
    for value in (cfg.get("eos_token_id"), generation.get("eos_token_id")):
        for i in value if isinstance(value, list) else [value]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return ids
