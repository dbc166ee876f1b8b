"""Idefics3's (and SmolVLM's) vision transformer in plain torch, SigLIP's shape: patches
embedded by a biased convolution, learned absolute positions, CLIP's pre-norm blocks
(clip.py: biased q/k/v/out projections; here the tanh-approximated GELU), a final
LayerNorm; then the connector:
a pixel shuffle folding each scale x scale block of patches into one token, and a linear
map (no bias) to the decoder's width.

Parameter names are transformers 5's Idefics3VisionTransformer's and connector's
(vision_model.embeddings.{patch_embedding,position_embedding},
vision_model.encoder.layers.N.{layer_norm1,self_attn.{q,k,v,out}_proj,layer_norm2,mlp.fc1,
mlp.fc2}, vision_model.post_layernorm, connector.modality_projection.proj). Every tile the
image processor makes is a full image_size square, so its positions are simply 0..n-1
(transformers' bucketed positions reduce to that for a tile with no padding).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .clip import Encoder
# Idefics3VisionConfig's defaults
DEFAULTS = {"hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12,
            "num_attention_heads": 16, "num_channels": 3, "image_size": 224, "patch_size": 32,
            "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}


class Embeddings(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        d, p = cfg["hidden_size"], cfg["patch_size"]
        self.patch_embedding = nn.Conv2d(cfg["num_channels"], d, kernel_size=p, stride=p)
        self.position_embedding = nn.Embedding((cfg["image_size"] // p) ** 2, d)
        self.patch = p

    def forward(self, tiles: Tensor) -> Tensor:
        """[T, C, S, S] -> [T, patches, D]."""
        w, b = self.patch_embedding.weight, self.patch_embedding.bias
        t, c, s, _ = tiles.shape
        p = self.patch
        patches = (tiles.to(w.dtype).view(t, c, s // p, p, s // p, p).permute(0, 2, 4, 1, 3, 5)
                   .reshape(t, -1, c * p * p))
        return F.linear(patches, w.view(w.shape[0], -1), b) + self.position_embedding.weight


class VisionModel(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])

    def forward(self, tiles: Tensor) -> Tensor:
        x = self.embeddings(tiles)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class ModalityProjection(nn.Module):
    def __init__(self, width: int, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(width, hidden_size, bias=False)


class Connector(nn.Module):
    def __init__(self, cfg: dict, scale: int, hidden_size: int):
        super().__init__()
        self.scale = scale
        self.modality_projection = ModalityProjection(cfg["hidden_size"] * scale ** 2,
                                                      hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        """[T, patches, D] -> [T * patches / scale^2, hidden]: each scale x scale block of
        patches (row-major inside) becomes one token, blocks in row-major order."""
        t, n, d = x.shape
        side, s = int(n ** 0.5), self.scale
        x = (x.view(t, side // s, s, side // s, s, d).permute(0, 1, 3, 2, 4, 5)
             .reshape(t, -1, s * s * d))
        return self.modality_projection.proj(x).reshape(-1, self.modality_projection.proj
                                                        .out_features)
