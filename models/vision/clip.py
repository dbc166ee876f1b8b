"""CLIP's vision transformer in plain torch (LLaVA's vision tower): one image of fixed size,
14-pixel (by config) patches embedded by a convolution, a class token, learned absolute
positions, a LayerNorm before the blocks ("pre_layrnorm", CLIP's spelling), pre-norm blocks
with biased q/k/v/out projections and the config's activation (quick_gelu).

Parameter names are transformers 5's CLIPVisionModel's (embeddings.*, pre_layrnorm,
encoder.layers.N.{layer_norm1,self_attn.{q,k,v,out}_proj,layer_norm2,mlp.fc1,mlp.fc2},
post_layernorm: loaded, unused by LLaVA). `forward(pixels, layer)` returns the hidden
states after `layer` blocks (transformers' hidden_states[layer]: 0 is pre_layrnorm's
output, negative counts from the end), class token first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .qwen2_vl import ACTIVATIONS

# CLIPVisionConfig's defaults, for keys a saved config leaves out
DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
            "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 32,
            "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}


class Embeddings(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        d, p = cfg["hidden_size"], cfg["patch_size"]
        self.patch = p
        self.class_embedding = nn.Parameter(torch.empty(d))
        self.patch_embedding = nn.Conv2d(cfg["num_channels"], d, kernel_size=p, stride=p,
                                         bias=False)
        self.position_embedding = nn.Embedding((cfg["image_size"] // p) ** 2 + 1, d)

    def forward(self, pixels: Tensor) -> Tensor:
        """[C, H, W] -> [1 + patches, D]."""
        w = self.patch_embedding.weight
        c, h, wd = pixels.shape
        p = self.patch
        patches = (pixels.to(w.dtype).view(c, h // p, p, wd // p, p).permute(1, 3, 0, 2, 4)
                   .reshape(-1, c * p * p))        # row-major patches, as the conv's output
        x = torch.cat((self.class_embedding[None], F.linear(patches, w.view(w.shape[0], -1))))
        return x + self.position_embedding.weight


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        """Full attention over the tokens of x [..., n, D] (any leading dims: images)."""
        q, k, v = (proj(x).unflatten(-1, (self.heads, -1)).transpose(-2, -3)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(o.transpose(-2, -3).flatten(-2))


class Mlp(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.fc1 = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"])
        self.fc2 = nn.Linear(cfg["intermediate_size"], cfg["hidden_size"])
        self.act = ACTIVATIONS[cfg["hidden_act"]]

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Layer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        d, eps = cfg["hidden_size"], cfg["layer_norm_eps"]
        self.layer_norm1 = nn.LayerNorm(d, eps=eps)
        self.self_attn = Attention(d, cfg["num_attention_heads"])
        self.layer_norm2 = nn.LayerNorm(d, eps=eps)
        self.mlp = Mlp(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    """The blocks (SigLIP's are the same: siglip.py)."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg["num_hidden_layers"]))


class ClipVisionTransformer(nn.Module):
    def __init__(self, vision_config: dict):
        super().__init__()
        cfg = self.cfg = {**DEFAULTS, **vision_config}
        if cfg["hidden_act"] not in ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {cfg['hidden_act']!r}")
        self.embeddings = Embeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])
        self.encoder = Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])

    @property
    def patches(self) -> int:
        return (self.cfg["image_size"] // self.cfg["patch_size"]) ** 2

    def forward(self, pixels: Tensor, layer: int) -> Tensor:
        """pixels [C, S, S] -> [1 + patches, D], the hidden states after `layer` blocks."""
        blocks = len(self.encoder.layers)
        layer = layer % (blocks + 1)
        x = self.pre_layrnorm(self.embeddings(pixels))
        for block in self.encoder.layers[:layer]:
            x = block(x)
        return x
