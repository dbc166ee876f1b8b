"""RoPE's numbers, in one place: the rotation frequencies each rope type gives, the attention
factor some types apply to cos and sin, and the [max_positions, rotary_dim] cos|sin table
that every rotation reads (ops.Rotary on the torch path, kernels/decode.c on the one-call
decode path: both read the model's `cos_sin` buffer, so they agree by construction).

    inv_freq(config, long=False)  -> [rotary_dim / 2] float32 frequencies
    attention_factor(config)      -> the float cos and sin are multiplied by (1.0 for most)
    cos_sin_table(config)         -> [max_position_embeddings, rotary_dim] float32: cos in the
                                     first half, sin in the second, times attention_factor

Each type follows transformers' ROPE_INIT_FUNCTIONS (transformers.modeling_rope_utils) term
for term, in the same float32 operations, so the tables are its cos/sin bit for bit
(tests/test_rope.py); `rotary_dim` is the head dim, or Phi-3's partial rotary part of it.

Two types depend, in transformers, on the length of the sequence each forward sees; a serving
system holds one table for every position instead (a request's KV entries are computed once
and shared through the prefix cache, so a position must rotate the same way whatever follows
it or runs beside it):
- "dynamic" (NTK): transformers rescales the base once a sequence grows past
  max_position_embeddings and uses the plain frequencies below that. The launcher never
  serves past max_position_embeddings, so the table is transformers' at that length, which
  is its table for every length we serve. (vLLM instead builds one table with the base
  already rescaled for factor * max_position_embeddings positions: longer contexts, but not
  transformers' numbers at any length.)
- "longrope" (Phi-3's "su"): transformers takes short_factor while the sequence fits in
  original_max_position_embeddings and long_factor for the whole forward once it does not.
  The table rotates positions below original_max_position_embeddings with the short factors
  and positions from there on with the long ones. That is transformers' own result for every
  prompt up to original_max_position_embeddings tokens, however long the generation runs
  (its prefill sees a short sequence, each later decode step rotates only its own new
  position, long from original_max_position_embeddings on, and the cached keys keep the
  rotation they had); a longer prompt gets, in transformers, the long factors at every
  position, and here still the short ones below original_max_position_embeddings.
  docs/models.md says what that means for users.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# What ModelConfig accepts; config.py refuses any other type at startup.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# Older spellings of a type: Phi-3's first checkpoints called longrope "su"; Qwen2-VL's
# configs name their multimodal sections "mrope" (plain RoPE frequencies).
ROPE_ALIASES = {"su": "longrope", "mrope": "default"}
# The parameters each type cannot do without (config.py names a missing one).
REQUIRED = {"linear": ("factor",), "dynamic": ("factor",),
            "yarn": ("original_max_position_embeddings",),   # factor: else the ratio
            "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings")}


def _exponents(dim: int, device) -> Tensor:
    """2i / dim for i < dim / 2, as transformers computes them (int64 arange, then float)."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def inv_freq(config, long: bool = False, device: torch.device | str | None = None) -> Tensor:
    """The [rotary_dim / 2] frequencies theta^(-2i/d) of config's rope type (config: a
    ModelConfig). long: longrope's long_factor set instead of its short_factor (other types
    ignore it)."""
    dim, base, s = config.rotary_dim, config.rope_theta, config.rope_scaling
    rope_type = "default" if s is None else s["rope_type"]
    if rope_type == "dynamic":
        # transformers' NTK base at the longest sequence served, max_position_embeddings,
        # computed as it does: the rescaling term is 1 there (up to its rounding, kept too)
        factor, length = s["factor"], config.max_position_embeddings
        base = base * ((factor * length / length) - (factor - 1)) ** (dim / (dim - 2))
    if rope_type == "longrope":
        ext = torch.tensor(s["long_factor"] if long else s["short_factor"],
                           dtype=torch.float32, device=device)
        return 1.0 / (ext * base ** _exponents(dim, device))
    if rope_type == "yarn":
        return _yarn(config, device)
    freqs = 1.0 / (base ** _exponents(dim, device))
    if rope_type == "linear":
        return freqs / s["factor"]
    if rope_type == "llama3":
        return _llama3(freqs, s)
    return freqs


def _llama3(freqs: Tensor, s: dict) -> Tensor:
    """Llama 3.1's rescaling: keep high frequencies (short wavelengths), divide low ones by
    `factor`, and interpolate linearly in 1/wavelength between the two bands."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freqs
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, freqs / factor, freqs)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_factor(config) -> float:
    s = config.rope_scaling
    if s.get("factor") is not None:
        return s["factor"]
    return config.max_position_embeddings / s["original_max_position_embeddings"]


def _yarn(config, device) -> Tensor:
    """YaRN (arXiv:2309.00071): frequencies that turn fewer than beta_slow times over the
    original context are interpolated (divided by factor), those that turn more than
    beta_fast times kept, with a linear ramp over the dims between."""
    s, dim, base = config.rope_scaling, config.rotary_dim, config.rope_theta
    factor = _yarn_factor(config)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
    old_len = s["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:      # the dim that turns `rotations` times
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                                       # (transformers' guard)
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)
    keep = 1 - ramp.clamp(0, 1)                             # 1: extrapolate, 0: interpolate
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def attention_factor(config) -> float:
    """What transformers multiplies cos and sin by (its `attention_scaling`): YaRN's and
    LongRoPE's temperature (the config's attention_factor, else one from the factor); 1.0
    for the other types."""
    s = config.rope_scaling
    rope_type = "default" if s is None else s["rope_type"]
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    old_len = s["original_max_position_embeddings"]
    if rope_type == "yarn":
        factor = _yarn_factor(config)

        def mscale(scale: float, m: float = 1) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if s.get("mscale") and s.get("mscale_all_dim"):
            return float(mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]))
        return mscale(factor)
    factor = s.get("factor")
    if factor is None:          # Phi-3: the ratio of the context to the original one
        factor = config.max_position_embeddings / old_len
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


def cos_sin_table(config, divisors: Tensor | None = None,
                  device: torch.device | str | None = None) -> Tensor:
    """[max_position_embeddings, rotary_dim] float32: cos(p * f) in the first half, sin in
    the second, times attention_factor (folded in here, so every reader of the table gets
    it). longrope: short factors below original_max_position_embeddings, long ones from
    there on (module docstring). divisors: a GGUF's rope_freqs tensor (one divisor per
    frequency: how llama.cpp's converter stores Llama 3's rescaling), or None."""
    positions = torch.arange(config.max_position_embeddings, device=device).float()
    s = config.rope_scaling
    if s is not None and s["rope_type"] == "longrope":
        cut = min(s["original_max_position_embeddings"], config.max_position_embeddings)
        freqs = torch.cat((torch.outer(positions[:cut], inv_freq(config, False, device)),
                           torch.outer(positions[cut:], inv_freq(config, True, device))))
    else:
        f = inv_freq(config, device=device)
        freqs = torch.outer(positions, f if divisors is None else f / divisors.float())
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    scale = attention_factor(config)
    return table if scale == 1.0 else table * scale
