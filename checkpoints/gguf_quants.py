"""Test-side quantizers from float weights to GGUF blocks, for the types gguf-py can
dequantize but not quantize: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS.

They are simple round-to-nearest quantizers, one scale (and, where the format has one, one
min) per (sub-)block, vectorized over blocks; not llama.cpp's search-based quantizers, so a
file made here is a little less accurate than one llama-quantize would make, but it is a
valid file of that type. Scale codes are rounded up (never down), so every sub-block's grid
covers all of its weights and each weight's error is at most half its sub-block's step (for
the non-uniform IQ4 grids: half the widest gap between neighbouring grid values). The byte
layouts are those that gguf-py's `dequantize_blocks` reads (gguf/quants.py), which is the
reference they are checked against (tests/test_gguf_quants.py). The types gguf-py quantizes
itself (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are delegated to it.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as _gq

T = GGMLQuantizationType

DELEGATED = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
OWN = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS)

# the non-uniform 4-bit grid of IQ4_NL and IQ4_XS (gguf-py: IQ4_NL.kvalues)
KVALUES = np.array(_gq.IQ4_NL.kvalues, dtype=np.float64)
_KV_MID = (KVALUES[1:] + KVALUES[:-1]) / 2

_F16_MAX = float(np.finfo(np.float16).max)


def quantize(weights: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 weights [rows, cols] -> uint8 [rows, cols // block * type_size]: the bytes
    that `gguf.quants.dequantize(out, qtype)` reads back as [rows, cols] (any leading
    dimensions are kept). cols must be a multiple of the type's block size. F32 / F16 come
    back as their bytes (uint8) too. ValueError for another type, a ragged row or a
    non-finite weight."""
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise ValueError(f"not a GGML quantization type: {qtype!r}") from None
    w = np.asarray(weights, dtype=np.float32)
    if w.ndim < 1:
        raise ValueError("weights must have at least one dimension")
    if qtype not in DELEGATED and qtype not in OWN:
        raise ValueError(f"cannot quantize to {qtype.name}")
    block, type_size = GGML_QUANT_SIZES[qtype]
    if w.shape[-1] % block:
        raise ValueError(f"{qtype.name}: row length {w.shape[-1]} is not a multiple of "
                         f"the block size {block}")
    out_shape = (*w.shape[:-1], w.shape[-1] // block * type_size)
    if qtype in DELEGATED:
        out = np.ascontiguousarray(_gq.quantize(w, qtype))
        return out.view(np.uint8).reshape(out_shape)
    if not np.isfinite(w).all():
        raise ValueError(f"{qtype.name}: weights must be finite")
    blocks = w.reshape(-1, block).astype(np.float64)
    out = _ENCODERS[qtype](blocks)
    assert out.dtype == np.uint8 and out.shape == (blocks.shape[0], type_size)
    return out.reshape(out_shape)


# ---- helpers -----------------------------------------------------------------------------

def _f16_up(x: np.ndarray) -> np.ndarray:
    """The least float16 >= x, for x >= 0 (capped at float16's largest finite value)."""
    x = np.minimum(x, _F16_MAX)
    h = x.astype(np.float16)
    return np.where(h.astype(np.float64) < x, np.nextafter(h, np.float16(np.inf)), h)


def _f16_bytes(h: np.ndarray) -> np.ndarray:
    """float16 [n, 1] -> its little-endian bytes [n, 2]."""
    return np.ascontiguousarray(h.astype("<f2")).view(np.uint8).reshape(-1, 2)


def _codes_up(s: np.ndarray, unit: np.ndarray, cmax: int) -> np.ndarray:
    """ceil(s / unit) in 0..cmax (0 where unit is 0): the scale code whose step covers s."""
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.where(unit > 0, np.ceil(s / unit), 0)
    return np.clip(c, 0, cmax).astype(np.uint8)


def _pack(q: np.ndarray, groups: int, fields: int, width: int, bits: int) -> np.ndarray:
    """Inverse of gguf-py's `x.reshape((n, groups, 1, width)) >> [0, bits, 2*bits, ...]`
    unpacking: element (g, k, p) of q reshaped [n, groups, fields, width] goes to byte
    g*width + p at bit bits*k."""
    q = q.astype(np.uint8).reshape(q.shape[0], groups, fields, width)
    out = np.zeros((q.shape[0], groups, width), dtype=np.uint8)
    for k in range(fields):
        out |= q[:, :, k, :] << np.uint8(bits * k)
    return out.reshape(q.shape[0], groups * width)


def _affine(blocks: np.ndarray, sub: int, qmax: int, cmax: int):
    """Sub-blocks of `sub` weights as d*sc*q - dmin*m with q in 0..qmax and sc, m codes in
    0..cmax: m covers the sub-block's negative part (mins are stored positive and
    subtracted), sc its range; the fp16 d and dmin are the largest sub-block's over cmax."""
    n = blocks.shape[0]
    x = blocks.reshape(n, -1, sub)
    hi, lo = x.max(-1), x.min(-1)
    m = np.maximum(-lo, 0.0)
    dmin = _f16_up(m.max(-1, keepdims=True) / cmax)
    mc = _codes_up(m, dmin.astype(np.float64), cmax)
    mins = dmin.astype(np.float64) * mc                         # >= m: -mins <= lo
    s = (hi + mins) / qmax                                      # step that reaches hi
    d = _f16_up(s.max(-1, keepdims=True) / cmax)
    sc = _codes_up(s, d.astype(np.float64), cmax)
    step = (d.astype(np.float64) * sc)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint((x + mins[..., None]) / step), 0)
    q = np.clip(q, 0, qmax).astype(np.uint8).reshape(n, -1)
    return d, dmin, sc, mc, q


def _extremes(x: np.ndarray, neg: float, pos: float):
    """For a signed grid reaching -neg..pos (in steps), per sub-block of x [..., sub]: the
    least step magnitude whose grid covers the sub-block when its largest-magnitude weight
    goes to the -neg end, and the sign of the step that does that."""
    hi, lo = x.max(-1), x.min(-1)
    top = hi >= -lo                                             # the extreme is positive
    big = np.where(top, hi, -lo)
    other = np.where(top, np.maximum(-lo, 0.0), np.maximum(hi, 0.0))
    return np.maximum(big / neg, other / pos), np.where(top, -1.0, 1.0)


def _symmetric(blocks: np.ndarray, sub: int, neg: int, pos: int, cmax: int):
    """Sub-blocks of `sub` weights as d*scale*q with q in -neg..pos and a signed scale code
    of magnitude <= cmax; the fp16 d is the largest sub-block's step over cmax."""
    n = blocks.shape[0]
    x = blocks.reshape(n, -1, sub)
    s, sign = _extremes(x, neg, pos)
    d = _f16_up(s.max(-1, keepdims=True) / cmax)
    scale = sign * _codes_up(s, d.astype(np.float64), cmax)
    step = (d.astype(np.float64) * scale)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step != 0, np.rint(x / step), 0)
    q = np.clip(q, -neg, pos).reshape(n, -1)
    return d, scale.astype(np.int16), q.astype(np.int16)


def _nearest_kvalue(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Index of the KVALUES entry nearest to x / step (step 0: the entry nearest 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(step != 0, x / step, 0.0)
    return np.searchsorted(_KV_MID, r).astype(np.uint8)


# ---- the formats (layouts: gguf-py's dequantize_blocks of the same name) -----------------

def _q2_k(blocks: np.ndarray) -> np.ndarray:
    # scales[16] (low nibble scale, high nibble min, per 16) | qs[64] | d | dmin
    d, dmin, sc, mc, q = _affine(blocks, 16, 3, 15)
    return np.concatenate([sc | (mc << np.uint8(4)), _pack(q, 2, 4, 32, 2),
                           _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def _q3_k_scales(code: np.ndarray) -> np.ndarray:
    """16 six-bit codes -> 12 bytes: low nibbles in bytes 0..7 (codes 8..15 in the high
    halves), the top two bits in bytes 8..11 (code i: byte 8 + i % 4, bits 2 * (i // 4))."""
    return np.concatenate([_pack(code & np.uint8(0x0F), 1, 2, 8, 4),
                           _pack(code >> np.uint8(4), 1, 4, 4, 2)], axis=1)


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    # hmask[32] | qs[64] (2-bit) | scales[12] (6-bit, minus 32, per 16) | d;
    # q = ql - 4 * (1 - hbit), i.e. q + 4 = hbit * 4 + ql
    d, scale, q = _symmetric(blocks, 16, 4, 3, 31)
    u = (q + 4).astype(np.uint8)
    return np.concatenate([_pack(u >> np.uint8(2), 1, 8, 32, 1),
                           _pack(u & np.uint8(3), 2, 4, 32, 2),
                           _q3_k_scales((scale + 32).astype(np.uint8)), _f16_bytes(d)], axis=1)


def _k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and 8 six-bit mins -> the 12 bytes Q4_K.get_scale_min unpacks:
    bytes 0..3 / 4..7 hold scales / mins 0..3 and, in their top two bits, the top bits of
    scales / mins 4..7, whose low nibbles are in bytes 8..11 (scale low, min high)."""
    top = np.uint8(0x30)
    return np.concatenate([
        (sc[:, :4] & np.uint8(0x3F)) | ((sc[:, 4:] & top) << np.uint8(2)),
        (mn[:, :4] & np.uint8(0x3F)) | ((mn[:, 4:] & top) << np.uint8(2)),
        (sc[:, 4:] & np.uint8(0x0F)) | ((mn[:, 4:] & np.uint8(0x0F)) << np.uint8(4)),
    ], axis=1)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    # d | dmin | scales[12] | qs[128] (per 64 weights: 32 low nibbles, then 32 high)
    d, dmin, sc, mc, q = _affine(blocks, 32, 15, 63)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scales(sc, mc),
                           _pack(q, 4, 2, 32, 4)], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    # d | dmin | scales[12] | qh[32] (bit k of byte p: weight 32k + p) | qs[128] as Q4_K
    d, dmin, sc, mc, q = _affine(blocks, 32, 31, 63)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scales(sc, mc),
                           _pack(q >> np.uint8(4), 1, 8, 32, 1),
                           _pack(q & np.uint8(0x0F), 4, 2, 32, 4)], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    # ql[128] (low nibbles, per 128 weights: 64 + 64) | qh[64] (top 2 bits, per 128: 4 x 32)
    # | scales[16] int8 per 16 | d; q in -32..31 stored + 32
    d, scale, q = _symmetric(blocks, 16, 32, 31, 127)
    u = (q + 32).astype(np.uint8)
    return np.concatenate([_pack(u & np.uint8(0x0F), 2, 2, 64, 4),
                           _pack(u >> np.uint8(4), 2, 4, 32, 2),
                           scale.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


def _iq4_nl(blocks: np.ndarray) -> np.ndarray:
    # d | qs[16] (weights 0..15 low nibbles, 16..31 high); w = d * KVALUES[nibble]
    s, sign = _extremes(blocks, -KVALUES[0], KVALUES[-1])
    d = (sign * _f16_up(s)).astype(np.float16)[:, None]
    idx = _nearest_kvalue(blocks, d.astype(np.float64))
    return np.concatenate([_f16_bytes(d), _pack(idx, 1, 2, 16, 4)], axis=1)


def _iq4_xs(blocks: np.ndarray) -> np.ndarray:
    # d | scales_h (uint16, 2 bits per 32 at bit 2j) | scales_l[4] (nibbles, sub-block 2b
    # low / 2b+1 high) | qs[128] (per 32 weights, 16 bytes as IQ4_NL); scale = code - 32
    n = blocks.shape[0]
    x = blocks.reshape(n, 8, 32)
    s, sign = _extremes(x, -KVALUES[0], KVALUES[-1])
    d = _f16_up(s.max(-1, keepdims=True) / 31)
    scale = sign * _codes_up(s, d.astype(np.float64), 31)
    code = (scale + 32).astype(np.uint16)
    high = ((code >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(-1, dtype=np.uint16)
    idx = _nearest_kvalue(x, (d.astype(np.float64) * scale)[..., None])
    return np.concatenate([_f16_bytes(d), high.astype("<u2").view(np.uint8).reshape(n, 2),
                           _pack((code & 0x0F).astype(np.uint8), 4, 2, 1, 4),
                           _pack(idx.reshape(n, -1), 8, 2, 16, 4)], axis=1)


_ENCODERS = {T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
             T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs}
