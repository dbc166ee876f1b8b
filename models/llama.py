"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM3, Phi-3, the mixtures of
experts Qwen3-MoE and Mixtral; Gemma 2 and 3 with their own layer: gemma.py) in plain torch.

The model runs over a flat, ragged batch: N tokens from any number of requests, each token
with its own position. Everything that mixes tokens of one request lives in the `attn`
object passed to `forward` (paged KV pool + attention kernel); every other op here is per
token, so the batch layout never matters to this file.

    attn(layer_id, q, k, v) -> o
        q: [N, num_heads, head_dim]; k, v: [N, num_kv_heads, head_dim]  (RoPE already applied;
        v may be a strided view). o: [N, num_heads, head_dim]. The softmax scale, sliding
        window and score cap of each layer are config.attention_layers()'s.

The families differ only in config flags (see ModelConfig): qkv/o/mlp biases, Qwen3's
per-head q/k RMSNorm, SmolLM3's layers without RoPE, Phi-3's partial rotary (RoPE on the
first rotary_dim dims of each head), tied embeddings, the RoPE table (rope.py: every rope
type is a different table), and which layers' MLP is a mixture of experts (moe.py:
SparseMoE; the others keep the dense MLP). q/k/v and gate/up are fused into one matmul
each; the loader fills the fused weights from the checkpoint's parts (or, Phi-3, its fused
tensors).
Tensor parallelism (`tp`, a group of models/distributed.py with size > 1): the module is built
with this rank's share of the heads, MLP columns and vocabulary (models/tp.py: Shard), and
three hooks join the ranks: the embedding and the two row-parallel projections (o_proj,
down_proj) all-reduce, and compute_logits gathers the vocabulary to rank 0. Each hook sits
behind `tp is not None`, so one rank runs exactly the code it ran before.
Numerics follow transformers' modeling_llama (RMSNorm in float32, RoPE tables cast to the
model dtype, logits in the model dtype then float32), so greedy outputs match it. The
elementwise ops live in ops.py (torch, or our C kernels on CPU); each layer adds its
residual inside the next norm (`norm(x, residual)`), as vLLM does, to fuse the two.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.distributed import SOLO

from .config import ModelConfig
from .gemma import GemmaDecoderLayer, GemmaRMSNorm
from .moe import SparseMoE
from .ops import ACT_AND_MUL, Rotary, rms_norm, rope_
from .rope import cos_sin_table
from .tp import Shard
from .vision import build_encoder


class AttentionBackend(Protocol):
    """KV cache + attention over a flat batch; see the module docstring."""

    def __call__(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None):
        """norm(x); with a residual, (norm(x + residual), x + residual)."""
        return rms_norm(x, self.weight, self.eps, residual)


def local_rope_config(config: ModelConfig) -> ModelConfig:
    """The config whose RoPE table Gemma 3's sliding-window layers use: their own base, no
    scaling."""
    return dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)


# Under tensor parallelism a row-parallel layer's bias is a parameter of its own, added once
# after the ranks' sums are joined: our parameter -> the HF module whose bias it is.
ROW_BIASES = {"self_attn.o_bias": "self_attn.o_proj", "mlp.down_bias": "mlp.down_proj"}


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp=None):
        """config: this rank's (its heads only); tp: the group under tensor parallelism,
        else None."""
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.qkv_bias)
        # Row-parallel under TP: the bias is added once, after the ranks' sums are joined.
        self.o_proj = nn.Linear(self.q_size, config.hidden_size,
                                bias=config.o_bias and tp is None)
        self.o_bias = (nn.Parameter(torch.empty(config.hidden_size))
                       if config.o_bias and tp is not None else None)
        # Qwen3 normalizes each head of q and k (over head_dim) before RoPE; others don't.
        self.qk_norm = config.qk_norm
        # SmolLM3's NoPE layers leave q and k as they are.
        self.rope = config.rope_layers is None or bool(config.rope_layers[layer_id])
        # Gemma 3's sliding-window layers rotate by their own table (CausalLM.forward).
        self.local_rope = (config.local_rope_theta is not None
                           and bool(config.layer_windows[layer_id]))
        if self.qk_norm:
            norm = GemmaRMSNorm if config.gemma else RMSNorm
            self.q_norm = norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = norm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: Tensor, rotary: Rotary, attn: AttentionBackend) -> Tensor:
        qkv = self.qkv_proj(x)
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        v = qkv[:, self.q_size + self.kv_size:].view(-1, kv_heads, d)
        if self.qk_norm:
            q = rope_(self.q_norm(qkv[:, :self.q_size].view(-1, heads, d)), rotary)
            k = rope_(self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size]
                                  .view(-1, kv_heads, d)), rotary)
        elif not self.rope:
            qk = qkv[:, :self.q_size + self.kv_size].view(-1, heads + kv_heads, d)
            q, k = qk[:, :heads], qk[:, heads:]
        else:                   # q and k heads sit side by side: rotate them in one pass
            qk = rope_(qkv[:, :self.q_size + self.kv_size].view(-1, heads + kv_heads, d),
                       rotary)
            q, k = qk[:, :heads], qk[:, heads:]
        o = attn(self.layer_id, q, k, v)
        o = self.o_proj(o.reshape(-1, self.q_size))
        if self.tp is not None:
            o = _join_row_parallel(self.tp, o, self.o_bias)
        return o


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp=None):
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size,
                                      bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size,
                                   bias=config.mlp_bias and tp is None)
        self.down_bias = (nn.Parameter(torch.empty(config.hidden_size))
                          if config.mlp_bias and tp is not None else None)
        self.act_and_mul = ACT_AND_MUL[config.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        out = self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
        if self.tp is not None:
            out = _join_row_parallel(self.tp, out, self.down_bias)
        return out


def _join_row_parallel(tp, partial: Tensor, bias: Tensor | None) -> Tensor:
    """A row-parallel layer's output: the ranks' partial sums summed, then the bias once."""
    out = tp.all_reduce_(partial)
    if bias is not None:
        out += bias
    return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp=None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoE(config, tp) if config.sparse(layer_id) else MLP(config, tp)

    def forward(self, x: Tensor, residual: Tensor | None, rotary: Rotary,
                attn: AttentionBackend) -> tuple[Tensor, Tensor]:
        """x: the previous layer's output, residual: the stream before it (None for the
        first layer) -> this layer's (output, residual stream before it)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rotary, attn)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """Parameter names are HF's minus the `model.` prefix, with q/k/v fused into
    `self_attn.qkv_proj` and gate/up into `mlp.gate_up_proj` (see loader.py), and a sparse
    layer's experts stacked as transformers 5 holds them (moe.py); under tensor
    parallelism the row-parallel biases are `self_attn.o_bias` and `mlp.down_bias`.

    `config` is the whole model's; `self.config` is what this rank holds (its heads, MLP
    columns and vocabulary block: the KV cache is sized from it), `self.vocab_size` the
    whole vocabulary, `self.shard` the Shard (None on one rank)."""

    def __init__(self, config: ModelConfig, tp=SOLO):
        super().__init__()
        self.tp = tp if tp.size > 1 else None
        self.shard = Shard.of(config, tp.size, tp.rank) if self.tp is not None else None
        self.vocab_size = config.vocab_size
        config = self.shard.config if self.shard is not None else config
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.gemma:
            self.layers = nn.ModuleList(
                GemmaDecoderLayer(config, SelfAttention(config, i, self.tp),
                                  MLP(config, self.tp)) for i in range(config.num_layers))
            self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        else:
            self.layers = nn.ModuleList(DecoderLayer(config, i, self.tp)
                                        for i in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Gemma scales the embeddings by sqrt(hidden_size), rounded to the model dtype.
        self.embed_scale = config.hidden_size ** 0.5 if config.gemma else None
        self.attention_layers = config.attention_layers()   # what the backend applies
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        # Built on the CPU even when the module is built on `meta`; load_model moves and casts it.
        self.register_buffer("cos_sin", cos_sin_table(config, device="cpu"), persistent=False)
        self.register_buffer("cos_sin_local", None if config.local_rope_theta is None else
                             cos_sin_table(local_rope_config(config), device="cpu"),
                             persistent=False)
        self.fast = None        # a FastDecode (fast_decode.py), set by load_model where it applies
        self.lora = None        # a LoraSet (lora.py), set by the runner with --enable-lora
        # A vision-language model's image encoder (models/vision/), else None: whole on
        # every rank (small next to the decoder), run by rank 0 alone (runner.py).
        self.vision = build_encoder(config)

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend,
                embeds: tuple | None = None) -> Tensor:
        """input_ids, positions: [N] -> [N, hidden], the residual stream after the last layer
        (compute_logits applies the final norm, only to the rows that need logits).
        embeds: (rows [M], values [M, hidden], rope [3, M] or None): those rows take these
        inputs in place of their tokens' embeddings (an image's encoder output), and under
        multimodal RoPE (config.mrope_section) these [t, h, w] positions."""
        if embeds is None and self.fast is not None and self.fast.takes(attn, positions) \
                and (self.lora is None or not self.lora.runs or self.lora.kernel is not None):
            return self.fast.run(input_ids, positions, attn)    # the same, in one C call
        x = (self.embed_tokens(input_ids) if self.tp is None
             else self._embed_sharded(input_ids))
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        rotary = Rotary(self.cos_sin, positions)
        if embeds is not None:
            x[embeds[0]] = embeds[1].to(x.dtype)
            if embeds[2] is not None:
                rotary = self._mrope(positions, embeds[0], embeds[2])
        local = None if self.cos_sin_local is None else Rotary(self.cos_sin_local, positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual,
                                local if layer.self_attn.local_rope else rotary, attn)
        return x + residual

    def _mrope(self, positions: Tensor, rows: Tensor, rope: Tensor) -> Rotary:
        """Multimodal RoPE (Qwen2-VL): the step's table rows, with image rows made of three:
        frequency j of the head takes the t, h or w position as mrope_section assigns it
        (in the cos half and the sin half alike). Text rows, whose three are equal, are the
        plain table's. The kernels then read this per-row table at 0..N-1."""
        table = self.cos_sin[positions]
        sections = torch.repeat_interleave(torch.arange(3, device=table.device),
                                           torch.tensor(self.config.mrope_section,
                                                        device=table.device))
        axis = torch.cat((sections, sections))                         # [D]: 0, 1 or 2
        three = self.cos_sin[rope]                                     # [3, M, D]
        table[rows] = three.gather(0, axis.expand(1, rope.shape[1], -1)).squeeze(0)
        return Rotary(table, torch.arange(positions.shape[0], device=positions.device))

    def _embed_sharded(self, input_ids: Tensor) -> Tensor:
        """Vocab-parallel embedding: this rank's rows for the ids in its block, 0 for the
        others, summed over the ranks (exactly one rank contributes each row)."""
        lo, hi = self.shard.vocab
        local = input_ids - lo
        outside = (local < 0) | (local >= hi - lo)
        x = self.embed_tokens(local.clamp(0, self.shard.vocab_rows - 1))
        x.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce_(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """hidden: [M, hidden] rows of forward's output -> [M, vocab] float32 logits. Under
        tensor parallelism every rank must call it (it gathers the vocabulary blocks):
        rank 0 gets the logits, the others None."""
        x = self.norm(hidden)
        if self.lm_head is None:                       # tied embeddings
            logits = F.linear(x, self.embed_tokens.weight)
        else:
            logits = self.lm_head(x)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits)
            if logits is None:
                return None
            logits = logits[:, :self.vocab_size]
        if (cap := self.config.final_softcap) is not None:      # in the model dtype, as HF
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
