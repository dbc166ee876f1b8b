"""Test doubles for the model's attention backend: without a KV cache (a flat batch of
whole sequences) and with a growing one (greedy decoding of one sequence). Both apply each
layer's models.config.LayerAttention when given the model's `attention_layers` (scale,
sliding window, score cap); without, plain causal attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _attend(layers: tuple, layer_id: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor,
            q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """[N, H, D] q against [T, Hkv, D] k, v where `mask` [N, T] allows; positions q_pos
    [N] and k_pos [T] place a layer's window."""
    # SDPA wants [batch=1, heads, N, head_dim] (the 4-D layout HF uses; 3-D inputs take
    # another CPU kernel that rounds differently in bf16); enable_gqa shares k/v heads.
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if not layers:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return o[0].transpose(0, 1)
    from scheduler_proc.attention import attend
    spec = layers[layer_id]
    if spec.window is not None:                     # positions within the window only
        mask = mask & (k_pos[None, :] > q_pos[:, None] - spec.window)
    return attend(q, k, v, mask, False, spec)[0].transpose(0, 1)


class DenseCausalAttention:
    """The model's `attn(layer_id, q, k, v)` with no cache: causal attention within each
    sequence of a flat batch. `seq_lens` splits the N tokens into consecutive sequences
    (default: all N tokens are one sequence); `layers`: the model's attention_layers."""

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
        return _attend(self.layers, layer_id, q, k, v, mask, idx, idx)


class CachedAttention:
    """A growing per-layer K/V cache for one sequence: greedy decoding without recompute.
    `layers`: the model's attention_layers."""

    def __init__(self, layers: tuple = ()):
        self.layers = layers
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}

    def __call__(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if layer_id in self.k:
            k = torch.cat([self.k[layer_id], k])
            v = torch.cat([self.v[layer_id], v])
        self.k[layer_id], self.v[layer_id] = k, v.contiguous()
        n, total = q.shape[0], k.shape[0]
        k_pos, q_pos = torch.arange(total), torch.arange(total - n, total)
        mask = k_pos[None, :] <= q_pos[:, None]
        return _attend(self.layers, layer_id, q, k, v, mask, q_pos, k_pos)
