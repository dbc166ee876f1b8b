"""The float-activation kernel on GGUF's blocks (models/kernels/blocks.c) and the rule that
picks it (QuantLinear, zs_linear_parts): every block type against the gguf library's
dequantize-then-matmul, on each ISA this machine has; the 8-row groups every part is kept in
(regroup) read back as gguf's values; a fused layer of parts in different types; which
kernel takes which M.

The kernel multiplies x as it is by weights w = d * q + m (a sub-block's scale d and offset
m, the code q: OFFSET_CODES below), in one of two ways: tiles of several rows of x take each
weight dequantized exactly as gguf.quants.dequantize gives it; a row alone (batch-1 decode)
takes d * sum(q x) + m * sum(x) per sub-block, the same real number with other roundings.
Either is a sum of at most 2K terms of magnitude |x_i| (|d q_i| + |m_i|), each product and
sum rounded once, in some order, plus at most two roundings of each weight in gguf's float32
values: |error| <= 2K * u * sum |x_i| (|d q_i| + |m_i|) to first order, with u = 2^-24, and
|d q_i| <= |w_i| + |m_i|; the bound below is K * 2^-22 * sum |x_i| (|w_i| + 2 |m_i|). m is 0
where no offset is taken apart: IQ4_NL and IQ4_XS have none (their row form takes only the
scale apart), Q2_K and Q3_K have the tiles' form only. A wrong layout moves outputs by the
size of the terms themselves, far past that.
"""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch

from checkpoints.gguf_quants import quantize
from models import kernels
from models.quant_linear import (BLOCK_TYPES, INT8_BATCH, INT8_TYPES, QuantLinear, dequantize,
                                 regroup, step_batch)

needs_kernels = pytest.mark.skipif(not kernels.avx2_available("cpu"),
                                   reason="no AVX2/FMA/F16C or no C compiler")
ISAS = [pytest.param("avx2", id="avx2"),
        pytest.param("avx512", id="avx512", marks=pytest.mark.skipif(
            not kernels.available("cpu", torch.float32),
            reason="this CPU has no AVX-512 (or ZSERVE_CPU_ISA=avx2 asks for AVX2 only)"))]

# The fp16 fields of each block (scales, mins): random bytes elsewhere are all valid codes.
FP16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
           "IQ4_NL": (0,), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
           "Q6_K": (208,), "IQ4_XS": (0,)}


def random_blocks(rng: np.random.Generator, qtype: str, n: int, k: int) -> np.ndarray:
    """n rows of random blocks: every bit pattern of the codes, finite small scales."""
    _, values, size = BLOCK_TYPES[qtype]
    raw = rng.integers(0, 256, size=(n, k // values, size), dtype=np.uint8)
    for off in FP16_AT[qtype]:
        scales = rng.uniform(0.002, 0.05, size=(n, k // values)).astype(np.float16)
        raw[:, :, off:off + 2] = scales.view(np.uint8).reshape(n, k // values, 2)
    return raw.reshape(n, -1)


def quantized_blocks(rng: np.random.Generator, qtype: str, n: int, k: int) -> np.ndarray:
    """Weights as a model's are: normal values quantized (checkpoints/gguf_quants.py)."""
    return quantize(rng.standard_normal((n, k)).astype(np.float32), getattr(gguf.GGMLQuantizationType, qtype))


def run_kernel(isa: str, qtype: str, blocks: np.ndarray, x: torch.Tensor, bias=None
               ) -> torch.Tensor:
    """blocks.c's kernel of one ISA, called directly on the regrouped blocks (GGUF rows
    given): y = x W^T (+ bias)."""
    n = blocks.shape[0]
    m, k = x.shape
    w = regroup(qtype, torch.from_numpy(np.ascontiguousarray(blocks)))
    y = torch.full((m, n), float("nan"))
    fn = getattr(kernels.library(), f"zs_linear_blocks_{isa}")
    rc = fn(BLOCK_TYPES[qtype][0], x.data_ptr(), m, k, w.data_ptr(), n,
            None if bias is None else bias.data_ptr(), y.data_ptr(), n)
    assert rc == 0
    return y


# Each type whose rows alone take the offset apart (blocks_impl.h: has_row): the bytes of a
# GGUF block that hold the codes q. With them zeroed, gguf's dequantization gives each
# weight's offset m (q = 0: Q4_0's -8d, Q4_1's m, Q4_K's -dmin * m, Q6_K's -32 d, Q8_0's 0).
OFFSET_CODES = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q5_0": (2, 22), "Q5_1": (4, 24),
                "Q8_0": (2, 34), "Q4_K": (16, 144), "Q5_K": (16, 176), "Q6_K": (0, 192)}


def offsets(qtype: str, blocks: np.ndarray, k: int) -> torch.Tensor:
    """m of every weight (module doc), [N, K]; zeros for the types without one."""
    if qtype not in OFFSET_CODES:
        return torch.zeros(blocks.shape[0], k)
    lo, hi = OFFSET_CODES[qtype]
    _, values, size = BLOCK_TYPES[qtype]
    zeroed = np.array(blocks).reshape(blocks.shape[0], -1, size)
    zeroed[:, :, lo:hi] = 0
    return dequantize(qtype, torch.from_numpy(zeroed.reshape(blocks.shape[0], -1)), k)


def assert_within_summation(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None,
                            m: torch.Tensor | None = None):
    """y against float64 x w^T (+ bias) within the module doc's bound; m: the weights'
    offsets (`offsets`), none if not given."""
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    size = w.double().abs() + (0 if m is None else 2 * m.double().abs())
    bound = x.shape[1] * 2.0 ** -22 * (x.double().abs() @ size.T) + 1e-30
    err = (y.double() - ref).abs()
    assert torch.isfinite(y).all()
    assert (err <= bound).all(), float((err / bound).max())
    return err, bound


SHAPES = [(1, 13, 256), (3, 37, 512), (32, 8, 768), (5, 1, 256)]


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", sorted(BLOCK_TYPES))
def test_every_type_equals_dequantize_then_matmul(isa, qtype):
    """Random codes (every bit pattern) and quantized normal weights, batch 1 to 32, output
    widths that are not multiples of the 8-row groups, with and without a bias."""
    rng = np.random.default_rng(sum(map(ord, qtype)))
    for m, n, k in SHAPES:
        for make in (random_blocks, quantized_blocks):
            blocks = make(rng, qtype, n, k)
            w = dequantize(qtype, torch.from_numpy(blocks), k)
            off = offsets(qtype, blocks, k)
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
            bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
            assert_within_summation(run_kernel(isa, qtype, blocks, x), x, w, m=off)
            assert_within_summation(run_kernel(isa, qtype, blocks, x, bias), x, w, bias, off)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_a_wrong_layout_is_caught(isa):
    """The bound is tight enough to mean something: the same Q4_K blocks read as if their
    rows were one byte off (the scales of one row, the codes of the next) are far out."""
    rng = np.random.default_rng(3)
    blocks = quantized_blocks(rng, "Q4_K", 8, 512)
    x = torch.from_numpy(rng.standard_normal((1, 512)).astype(np.float32))
    shifted = np.roll(blocks.reshape(-1), 1).reshape(blocks.shape)
    w = dequantize("Q4_K", torch.from_numpy(blocks), 512)
    off = offsets("Q4_K", blocks, 512)
    assert_within_summation(run_kernel(isa, "Q4_K", blocks, x), x, w, m=off)
    with pytest.raises(AssertionError):
        assert_within_summation(run_kernel(isa, "Q4_K", shifted, x), x, w, m=off)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", sorted(BLOCK_TYPES))
def test_rows_of_the_groups_are_gguf_values(isa, qtype):
    """regroup (quant_linear.py's FIELDS) and blocks.c's ungroup (its FIELDS) agree, and
    the scalar dequantization is gguf's to the bit: an embedding's row lookup
    (zs_dequant_rows) on the regrouped table gives gguf.quants.dequantize's rows exactly,
    the padding rows of the last group never read, an id out of range refused."""
    rng = np.random.default_rng(7)
    k = 512
    for n in (13, 8):
        blocks = random_blocks(rng, qtype, n, k)
        table = regroup(qtype, torch.from_numpy(blocks))
        ids = torch.tensor([n - 1, 0, 3, n - 1], dtype=torch.int64)
        out = torch.empty(len(ids), k)
        fn = getattr(kernels.library(), f"zs_dequant_rows_{isa}")
        assert fn(BLOCK_TYPES[qtype][0], table.data_ptr(), n, k, ids.data_ptr(), len(ids),
                  out.data_ptr()) == 0
        assert torch.equal(out, dequantize(qtype, torch.from_numpy(blocks), k)[ids])
        bad = torch.tensor([0, n], dtype=torch.int64)
        assert fn(BLOCK_TYPES[qtype][0], table.data_ptr(), n, k, bad.data_ptr(), 2,
                  out.data_ptr()) == -1


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 32])
def test_a_fused_layer_of_two_types(m):
    """q, k, v in Q4_K, Q4_K, Q6_K (Q4_K_M's attention): one QuantLinear of two parts (the
    two Q4_K merged), its output rows in part order, the bias split with them; each part's
    rows equal that part alone, on blocks.c's float kernel and on quant.c's int8 one (every
    part of this layer has both). Four runs of types are refused (blocks.c takes three)."""
    rng = np.random.default_rng(m)
    k, rows = 512, (16, 8, 8, 13)
    four = ["Q4_K", "Q6_K", "Q4_K", "Q8_0"]           # four runs of one type: too many
    with pytest.raises(ValueError, match="at most 3 parts"):
        QuantLinear(four, [torch.from_numpy(quantized_blocks(rng, t, r, k))
                           for t, r in zip(four, rows)], k)
    qtypes, rows = ["Q4_K", "Q4_K", "Q6_K"], rows[:3]
    parts = [quantized_blocks(rng, t, r, k) for t, r in zip(qtypes, rows)]
    bias = torch.from_numpy(rng.standard_normal(sum(rows)).astype(np.float32))
    layer = QuantLinear(qtypes, [torch.from_numpy(p) for p in parts], k, bias,
                        int8_batch=10 ** 6)
    assert layer.qtype == "Q4_K+Q6_K" and layer.parts == [("Q4_K", 24), ("Q6_K", 8)]
    assert sum(b.numel() for b in layer.buffers()) == sum(p.size for p in parts)  # the file's
    # bytes (the row counts here are multiples of 8: no padding rows)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    y = layer(x)
    w = torch.cat([dequantize(t, torch.from_numpy(p), k) for t, p in zip(qtypes, parts)])
    off = torch.cat([offsets(t, p, k) for t, p in zip(qtypes, parts)])
    assert_within_summation(y, x, w, bias, off)
    for int8_batch in (10 ** 6, 1):
        fused = QuantLinear(qtypes, [torch.from_numpy(p) for p in parts], k, bias,
                            int8_batch=int8_batch)(x)
        q4 = QuantLinear("Q4_K", torch.from_numpy(np.concatenate(parts[:2])), k,
                         bias[:24].clone(), int8_batch=int8_batch)
        q6 = QuantLinear("Q6_K", torch.from_numpy(parts[2]), k, bias[24:].clone(),
                         int8_batch=int8_batch)
        assert torch.equal(fused, torch.cat([q4(x), q6(x)], dim=1)), int8_batch
    assert not torch.equal(fused, y)                  # int8: x really was rounded


@needs_kernels
@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_int8_from_int8_batch_float_below(qtype):
    """The rule, with int8_batch = 8 and no model step (the batch is M): below 8 rows of x,
    blocks.c (float x: within summation of the dequantized product); from 8 on, quant.c (x
    rounded to int8: equal to a layer that takes quant.c always, and off the float product
    by more than summation). The default (INT8_BATCH = 32, --int8-activation-batch) takes
    float x below 32 and quant.c from 32 on. Inside a model step (step_batch) the step's
    requests are the batch, not the rows: one request's 64-row prefill stays float, one
    row of a 32-request step takes int8."""
    rng = np.random.default_rng(9)
    k = 256
    raw = random_blocks(rng, qtype, 24, k)
    blocks = torch.from_numpy(raw)
    w, off = dequantize(qtype, blocks, k), offsets(qtype, raw, k)
    eight = QuantLinear(qtype, blocks, k, int8_batch=8)
    always_int8 = QuantLinear(qtype, blocks, k, int8_batch=1)
    never_int8 = QuantLinear(qtype, blocks, k, int8_batch=10 ** 6)
    default = QuantLinear(qtype, blocks, k)
    assert INT8_BATCH == 32
    for m in (1, 7):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        assert_within_summation(eight(x), x, w, m=off)
        assert not torch.equal(eight(x), always_int8(x))
        assert torch.equal(default(x), never_int8(x))
    x = torch.from_numpy(rng.standard_normal((8, k)).astype(np.float32))
    assert torch.equal(eight(x), always_int8(x))
    with pytest.raises(AssertionError):
        assert_within_summation(eight(x), x, w, m=off)
    for m, kernel in ((INT8_BATCH - 1, never_int8), (INT8_BATCH, always_int8)):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        assert torch.equal(default(x), kernel(x))
    prefill = torch.from_numpy(rng.standard_normal((64, k)).astype(np.float32))
    row = torch.from_numpy(rng.standard_normal((1, k)).astype(np.float32))
    with step_batch(1):
        assert torch.equal(default(prefill), never_int8(prefill))
    with step_batch(INT8_BATCH):
        assert torch.equal(default(row), always_int8(row))
    assert torch.equal(default(prefill), always_int8(prefill))      # the step is over


@needs_kernels
@pytest.mark.parametrize("qtype", sorted(set(BLOCK_TYPES) - set(INT8_TYPES)))
def test_types_without_int8_stay_float_at_every_m(qtype):
    """Types without an int8 kernel (Q2_K, Q3_K) stay on blocks.c at any M (a 64-row
    prefill too)."""
    assert sorted(set(BLOCK_TYPES) - set(INT8_TYPES)) == ["Q2_K", "Q3_K"]
    rng = np.random.default_rng(11)
    blocks = torch.from_numpy(quantized_blocks(rng, qtype, 9, 256))
    x = torch.from_numpy(rng.standard_normal((64, 256)).astype(np.float32))
    assert_within_summation(QuantLinear(qtype, blocks, 256)(x), x,
                            dequantize(qtype, blocks, 256))


def test_struct_matches_blocks_c():
    """QuantLinear's ctypes description has blocks.c's ZsBlocks layout: 4 int64 fields, then
    MAX_PARTS parts of 3 int64 and a pointer; the fields tables agree in size."""
    from models.quant_linear import FIELDS, MAX_PARTS, _Blocks, _Part
    for qtype, fields in FIELDS.items():
        assert sum(size for _, size in fields) == BLOCK_TYPES[qtype][2]
        assert all(off == sum(s for _, s in fields[:i]) for i, (off, _) in enumerate(fields))
    assert ctypes.sizeof(_Part) == 32 and ctypes.sizeof(_Blocks) == 32 + 32 * MAX_PARTS
    assert "#define ZS_MAX_PARTS 3" in (kernels.HERE / "blocks.c").read_text()
    assert MAX_PARTS == 3
