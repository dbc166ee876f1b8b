"""Gemma 2 and Gemma 3's decoder layer and norm, over llama.py's attention and MLP.

What makes a Gemma layer (transformers' modeling_gemma2 / modeling_gemma3):
- RMSNorm scales by (1 + weight), in float32, then casts (Llama casts, then scales);
- four norms a layer: before attention, on attention's output (before the residual add),
  before the MLP, on the MLP's output; HF's names, so `post_attention_layernorm` here is
  the norm of attention's output, not (as in Llama) the one before the MLP;
- the MLP is GeGLU (config.hidden_act "gelu_tanh", llama.MLP), the embeddings are scaled
  by sqrt(hidden_size) and, in Gemma 2, the logits soft-capped (llama.CausalLM);
- attention per layer (config.attention_layers(): query_pre_attn_scalar's scale, the
  sliding window on local layers, Gemma 2's score soft-capping), applied by the attention
  backend; Gemma 3 adds per-head q/k norms (these norms too) and its local layers' own
  RoPE base (CausalLM keeps a second table).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .ops import rms_norm


class GemmaRMSNorm(nn.Module):
    """`weight` is the checkpoint's; the norm multiplies by (1 + weight) in float32. A
    float32 model runs our rms_norm kernel with that gain (the same products, in the same
    order); other dtypes round as transformers does: scale in float32, then cast."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self._gain: Tensor | None = None    # 1 + weight in float32, made on first use

    def forward(self, x: Tensor, residual: Tensor | None = None):
        """norm(x); with a residual, (norm(x + residual), x + residual)."""
        if self._gain is None:      # the weights are loaded by then and never change
            self._gain = 1.0 + self.weight.detach().float()
        if x.dtype == torch.float32:
            return rms_norm(x, self._gain, self.eps, residual)
        h = x if residual is None else x + residual
        hf = h.float()
        y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.eps) * self._gain
             ).to(h.dtype)
        return y if residual is None else (y, h)


class GemmaDecoderLayer(nn.Module):
    """self_attn and mlp are llama.py's SelfAttention and MLP, built by CausalLM."""

    def __init__(self, config, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)

    def forward(self, x: Tensor, residual: Tensor | None, rotary,
                attn) -> tuple[Tensor, Tensor]:
        """As llama.DecoderLayer: (output, residual stream before it); the stream after
        the layer is their sum."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rotary, attn))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual
