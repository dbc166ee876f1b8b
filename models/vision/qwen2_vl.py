"""Qwen2-VL's vision transformer in plain torch (Sarashina2-Vision's encoder): 14 x 14
patches (two frames deep: an image is its own frame twice) embedded by one linear map, ViT
blocks with 2-D rotary positions (h and w, each over a quarter of the head), full attention
within the image, and a merger that folds each 2 x 2 block of patches into one token of the
decoder's width.

Parameter names are transformers' Qwen2VisionTransformerPretrainedModel's (patch_embed.proj,
blocks.N.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}, merger.{ln_q,mlp.0,mlp.2}), and
so are the numerics: LayerNorm eps 1e-6, RoPE applied in float32, the activation from the
config (quick_gelu by default), the merger's exact GELU. The pixels come in the order the
image processor writes them (media/processors.py Qwen2VLImages: merge blocks of patches,
row-major), which is also the order of the merged tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Qwen2VLVisionConfig's defaults: a config saved as its difference from them names few keys
DEFAULTS = {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "hidden_act": "quick_gelu",
            "mlp_ratio": 4, "num_heads": 16, "in_channels": 3, "patch_size": 14,
            "spatial_merge_size": 2, "temporal_patch_size": 2}
# transformers' ACT2FN names of the activations the vision families use
ACTIVATIONS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


def vision_settings(vision_config: dict) -> dict:
    """The vision_config with the defaults filled in (`in_chans` is an older name)."""
    cfg = {**DEFAULTS, **vision_config}
    if "in_chans" in vision_config and "in_channels" not in vision_config:
        cfg["in_channels"] = vision_config["in_chans"]
    if cfg["hidden_act"] not in ACTIVATIONS:
        raise ValueError(f"unsupported vision hidden_act {cfg['hidden_act']!r}")
    return cfg


class PatchEmbed(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        t, p = cfg["temporal_patch_size"], cfg["patch_size"]
        self.proj = nn.Conv3d(cfg["in_channels"], cfg["embed_dim"], kernel_size=(t, p, p),
                              stride=(t, p, p), bias=False)

    def forward(self, pixels: Tensor) -> Tensor:
        """[N, C*T*P*P] -> [N, embed_dim]: the convolution's one window per patch is a
        matmul by its weight flattened the same way."""
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.view(w.shape[0], -1))


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1))
        return self.proj(o.transpose(0, 1).reshape(n, -1))


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE in float32, back to x's dtype. x: [N, heads, d]; cos, sin: [N, d]."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionMlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = ACTIVATIONS[act]

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        dim = cfg["embed_dim"]
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, cfg["num_heads"])
        self.mlp = VisionMlp(dim, int(dim * cfg["mlp_ratio"]), cfg["hidden_act"])

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.width = cfg["embed_dim"] * cfg["spatial_merge_size"] ** 2
        self.ln_q = nn.LayerNorm(cfg["embed_dim"], eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(),
                                 nn.Linear(self.width, cfg["hidden_size"]))

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen2VisionTransformer(nn.Module):
    def __init__(self, vision_config: dict):
        super().__init__()
        cfg = self.cfg = vision_settings(vision_config)
        self.merge = cfg["spatial_merge_size"]
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg["depth"]))
        self.merger = PatchMerger(cfg)
        self.theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))

    @property
    def patch_width(self) -> int:
        """Values per patch: C * T * P * P."""
        c = self.cfg
        return c["in_channels"] * c["temporal_patch_size"] * c["patch_size"] ** 2

    def tokens(self, grid: list[int]) -> int:
        """The merged tokens of an image with this grid [t, h, w]."""
        t, h, w = grid
        return t * h * w // self.merge ** 2

    def check(self, shape: list[int], grid: list[int]) -> str | None:
        """Why pixels of `shape` with `grid` cannot be this encoder's input, or None."""
        if len(grid) != 3 or min(grid) < 1 or grid[1] % self.merge or grid[2] % self.merge:
            return f"grid {grid} is not [t, h, w] with h and w multiples of {self.merge}"
        if shape != [grid[0] * grid[1] * grid[2], self.patch_width]:
            return f"pixels of shape {shape} do not match grid {grid}"
        return None

    def rotary(self, grid: list[int], device) -> tuple[Tensor, Tensor]:
        """cos, sin [t*h*w, head_dim] for the patches in the processor's order (merge
        blocks row-major, patches within a block row-major): the h angles then the w
        angles, twice (rotate-half pairs i with i + d/2)."""
        t, h, w = grid
        m = self.merge
        hpos = torch.arange(h, device=device)[:, None].expand(h, w)
        wpos = torch.arange(w, device=device)[None, :].expand(h, w)
        order = lambda p: p.reshape(h // m, m, w // m, m).transpose(1, 2).flatten()  # noqa: E731
        pos = torch.stack((order(hpos), order(wpos)), dim=-1).repeat(t, 1)
        half = self.cfg["embed_dim"] // self.cfg["num_heads"] // 2     # of a head
        inv_freq = 1.0 / self.theta ** (torch.arange(0, half, 2, dtype=torch.float,
                                                     device=device) / half)
        freqs = (pos[..., None].float() * inv_freq).flatten(1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    @torch.inference_mode()
    def forward(self, pixels: Tensor, grid: list[int]) -> Tensor:
        """pixels [t*h*w, C*T*P*P] -> [t*h*w / merge^2, hidden_size]."""
        x = self.patch_embed(pixels)
        cos, sin = self.rotary(grid, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.merger(x)
