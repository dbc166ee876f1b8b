"""Test doubles for the model: attention without a KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class DenseCausalAttention:
    """The model's `attn(layer_id, q, k, v)` with no cache: causal attention within each
    sequence of a flat batch. `seq_lens` splits the N tokens into consecutive sequences
    (default: all N tokens are one sequence); `layers`: the model's attention_layers (each
    layer's scale, sliding window, score cap; default: plain causal attention)."""

    def __init__(self, seq_lens: list[int] | None = None, layers: tuple = ()):
        self.seq_lens = seq_lens
        self.layers = layers

    def __call__(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n = q.shape[0]
        lens = self.seq_lens or [n]
        assert sum(lens) == n, (lens, n)
        # Block-diagonal causal mask: token i sees token j iff same sequence and j <= i.
        seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(q.device)
        idx = torch.arange(n, device=q.device)
        mask = (seq[:, None] == seq[None, :]) & (idx[None, :] <= idx[:, None])
        # SDPA wants [batch=1, heads, N, head_dim] (the 4-D layout HF uses; 3-D inputs take
        # another CPU kernel that rounds differently in bf16); enable_gqa shares k/v heads.
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if not self.layers:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            return o[0].transpose(0, 1)
        from scheduler_proc.attention import attend
        spec = self.layers[layer_id]
        if spec.window is not None:                 # positions within the window only
            mask = mask & (idx[None, :] > idx[:, None] - spec.window)
        return attend(q, k, v, mask, False, spec)[0].transpose(0, 1)
