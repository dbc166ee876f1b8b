"""checkpoints/gguf_quants.quantize writes GGUF blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
IQ4_NL, IQ4_XS) that gguf-py's own dequantize reads back as the weights, each within the
error the format allows a round-to-nearest quantizer; the types gguf-py quantizes itself
are passed through to it unchanged.

The per-weight bound is derived from each format, not from a run: a sub-block whose grid
covers its weights has error <= half its step (for the non-uniform IQ4 grid: half its widest
gap, 24 of the grid's units between 89 and 113). The least step that covers a sub-block
follows from its extremes and the number of levels; the stored step exceeds it by at most
one unit of the scale code (the largest sub-block's step over the code's top value, the
unit itself an fp16 rounded up by < 2**-10), and for the K types with mins by the min
code's unit spread over the levels. A float32 term (2**-20 of the sub-block's largest
weight) covers the dequantizer's arithmetic."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

from checkpoints.gguf_quants import DELEGATED, KVALUES, OWN, quantize

T = gguf.GGMLQuantizationType

# type -> (kind, sub-block size, format parameters)
#   affine: d*sc*q - dmin*m, q in 0..levels, sc and m codes in 0..code_max
#   symmetric: d*scale*q, q in -neg..pos, |scale| <= code_max
#   grid: (d*scale)*KVALUES[i], |scale| <= code_max (None: the fp16 d is the step itself)
FORMATS = {
    T.Q2_K: ("affine", 16, dict(levels=3, code_max=15)),
    T.Q3_K: ("symmetric", 16, dict(neg=4, pos=3, code_max=31)),
    T.Q4_K: ("affine", 32, dict(levels=15, code_max=63)),
    T.Q5_K: ("affine", 32, dict(levels=31, code_max=63)),
    T.Q6_K: ("symmetric", 16, dict(neg=32, pos=31, code_max=127)),
    T.IQ4_NL: ("grid", 32, dict(code_max=None)),
    T.IQ4_XS: ("grid", 32, dict(code_max=31)),
}
# the bytes of each block holding the quants themselves (not scales): gguf-py's layouts
QUANT_BYTES = {T.Q2_K: (16, 80), T.Q3_K: (32, 96), T.Q4_K: (16, 144), T.Q5_K: (48, 176),
               T.Q6_K: (0, 128), T.IQ4_NL: (2, 18), T.IQ4_XS: (8, 136)}
GRID_HALF_GAP = np.diff(KVALUES).max() / 2                      # 12
BITS = {T.Q2_K: 2, T.Q3_K: 3, T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 6, T.IQ4_NL: 4, T.IQ4_XS: 4}


def _up16(x):
    """An upper bound on x rounded up to a float16."""
    return x * (1 + 2.0 ** -10) + 2.0 ** -24


def _extreme_step(x, neg, pos):
    """Least step of a -neg..pos grid covering each sub-block of x [..., sub], its
    largest-magnitude weight at the -neg end (the scale is signed)."""
    hi, lo = x.max(-1), x.min(-1)
    top = hi >= -lo
    big = np.where(top, hi, -lo)
    other = np.where(top, np.maximum(-lo, 0), np.maximum(hi, 0))
    return np.maximum(big / neg, other / pos)


def _bounds(w, qtype):
    """(per-weight error bound, per-sub-block ideal step, grid gap factor) for w [rows,
    cols] in qtype, in float64: the bound shaped like w; the ideal step (the least step
    that covers the sub-block, no code rounding) and the factor turning it into a typical
    spacing of grid values, for the RMS check."""
    kind, sub, p = FORMATS[qtype]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    x = w.astype(np.float64).reshape(-1, block // sub, sub)    # [blocks, sub-blocks, sub]
    if kind == "affine":
        m = np.maximum(-x.min(-1), 0)                           # mins stored positive
        ideal = (x.max(-1) + m) / p["levels"]
        m_unit = _up16(m.max(-1, keepdims=True) / p["code_max"])
        s = ideal + m_unit / p["levels"]
        step = s + _up16(s.max(-1, keepdims=True) / p["code_max"])
        err, spacing = step / 2, 1.0
    elif kind == "symmetric":
        ideal = _extreme_step(x, p["neg"], p["pos"])
        step = ideal + _up16(ideal.max(-1, keepdims=True) / p["code_max"])
        err, spacing = step / 2, 1.0
    else:
        ideal = _extreme_step(x, -KVALUES[0], KVALUES[-1])
        if p["code_max"] is None:
            step = _up16(ideal)
        else:
            step = ideal + _up16(ideal.max(-1, keepdims=True) / p["code_max"])
        err, spacing = GRID_HALF_GAP * step, np.diff(KVALUES).mean()
    err = err + 2.0 ** -20 * np.abs(x).max(-1)
    return np.broadcast_to(err[..., None], x.shape).reshape(w.shape), ideal, spacing


def _matrices():
    rng = np.random.default_rng(1234)
    normal = rng.standard_normal((8, 512)).astype(np.float32)
    mixed = rng.standard_normal((10, 512)).astype(np.float32)
    mixed[1] *= 0.02                                            # weight-like scale
    mixed[2] = 0                                                # all-zero row
    mixed[3] = 0.37                                             # constant rows
    mixed[4] = -1.2
    mixed[5] = rng.random(512)                                  # all positive: no mins
    mixed[6, 7] = 40.0                                          # an outlier in a block
    mixed[7] *= np.repeat(10.0 ** rng.uniform(-3, 1, 32), 16)   # sub-blocks of all sizes
    mixed[8] *= 1e-3
    mixed[9] = -np.abs(mixed[9])                                # all negative
    return {"normal": normal, "mixed": mixed}


MATRICES = _matrices()


@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("qtype", OWN, ids=lambda t: t.name)
def test_roundtrip_within_the_format_bound(qtype, name):
    w = MATRICES[name]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    packed = quantize(w, qtype)
    assert packed.dtype == np.uint8
    assert packed.shape == (w.shape[0], w.shape[1] // block * type_size)
    back = dequantize(packed, qtype)
    assert back.shape == w.shape and back.dtype == np.float32
    assert np.isfinite(back).all()
    err = np.abs(back.astype(np.float64) - w)
    bound, _, _ = _bounds(w, qtype)
    worst = np.unravel_index(np.argmax(err - bound), w.shape)
    assert (err <= bound).all(), (qtype.name, worst, err[worst], bound[worst])
    if name == "mixed":
        assert (back[2] == 0).all()                             # zeros stay exactly zero


@pytest.mark.parametrize("qtype", OWN, ids=lambda t: t.name)
def test_rms_error_follows_from_the_bits(qtype):
    """On normal weights the RMS error is within 2x of a uniform quantizer's with the
    ideal step (step / sqrt(12); for the IQ4 grid its mean spacing of values), and well
    below the weights' own spread: under 2 ** (1 - bits) of it, halving with each bit."""
    w = MATRICES["normal"]
    err = dequantize(quantize(w, qtype), qtype).astype(np.float64) - w
    rms = np.sqrt(np.mean(err ** 2))
    _, ideal, spacing = _bounds(w, qtype)
    assert rms <= 2 * spacing * np.sqrt(np.mean(ideal ** 2) / 12), qtype.name
    assert rms < 2.0 ** (1 - BITS[qtype]) * w.std(), qtype.name


@pytest.mark.parametrize("qtype", OWN, ids=lambda t: t.name)
def test_a_wrong_layout_breaks_the_bound(qtype):
    """The bound can fail: the same bytes with each block's quants reversed (scales kept)
    read back far outside it, with an error like the weights' own spread, not the step."""
    w = MATRICES["normal"]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    packed = quantize(w, qtype).reshape(-1, type_size).copy()
    lo, hi = QUANT_BYTES[qtype]
    packed[:, lo:hi] = packed[:, lo:hi][:, ::-1]
    back = dequantize(packed.reshape(w.shape[0], -1), qtype).astype(np.float64)
    bound, _, _ = _bounds(w, qtype)
    assert np.mean(np.abs(back - w) > bound) > 0.3, qtype.name
    assert np.sqrt(np.mean((back - w) ** 2)) > 0.25 * w.std(), qtype.name


def test_delegated_types_are_gguf_py_s_own_bytes():
    w = MATRICES["mixed"]
    ref = gguf.quants.quantize(w, T.Q8_0)
    got = quantize(w, T.Q8_0)
    assert got.dtype == np.uint8 and got.shape == ref.shape
    assert np.array_equal(got, ref)
    for qtype in DELEGATED:
        got = quantize(w, qtype)
        assert got.dtype == np.uint8, qtype.name
        ref = np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8)
        assert np.array_equal(got, ref.reshape(got.shape)), qtype.name
        assert dequantize(got, qtype).shape == w.shape, qtype.name


def test_bad_requests_are_value_errors():
    w = MATRICES["normal"]
    with pytest.raises(ValueError, match="IQ2_XXS"):
        quantize(w, T.IQ2_XXS)                                  # gguf-py cannot either
    with pytest.raises(ValueError, match="block size 256"):
        quantize(w[:, :100], T.Q4_K)
    bad = w.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="finite"):
        quantize(bad, T.Q6_K)
