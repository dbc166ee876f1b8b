"""The decoder's elementwise ops (models/ops.py): our C kernels against the
torch code they replace, which is transformers' arithmetic. They must round at the same
places: bfloat16 results may differ only where a float32 sum rounds to the other side of
a bfloat16 tie (one ulp, rarely), float32 results only in summation order."""

from __future__ import annotations

import pytest
import torch

from models import ops

DTYPES = [torch.float32, torch.bfloat16]


def both(monkeypatch, dtype, fn):
    """fn() on our kernels, then on torch."""
    if ops._kernel(torch.empty(0, dtype=dtype)) is None:
        pytest.skip(f"no CPU kernels for {dtype} here")
    ours = fn()
    with monkeypatch.context() as m:
        m.setattr(ops, "_kernel", lambda x: None)
        ref = fn()
    return ours, ref


def assert_same(ours, ref, dtype, max_diff_fraction=0.01):
    assert ours.dtype == ref.dtype == dtype and ours.shape == ref.shape
    if dtype == torch.bfloat16:
        assert (ours != ref).float().mean() <= max_diff_fraction
        torch.testing.assert_close(ours, ref, atol=0, rtol=2 ** -7)
    else:
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 576), (7, 64), (130, 100), (3, 17)])
def test_rms_norm(monkeypatch, dtype, rows, dim):
    torch.manual_seed(0)
    x, r = torch.randn(rows, dim, dtype=dtype) * 3, torch.randn(rows, dim, dtype=dtype)
    w = torch.randn(dim, dtype=dtype)
    ours, ref = both(monkeypatch, dtype, lambda: ops.rms_norm(x, w, 1e-6))
    assert_same(ours, ref, dtype)
    (y, h), (y_ref, h_ref) = both(monkeypatch, dtype, lambda: ops.rms_norm(x, w, 1e-6, r))
    assert torch.equal(h, h_ref)                    # x + residual: one rounding either way
    assert_same(y, y_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [5, 8, 9, 31, 64, 100, 576, 1000, 1536, 4096, 5000])
def test_avx2_norm_is_torchs_bit_for_bit(monkeypatch, dtype, dim):
    """Without AVX-512, RMSNorm runs on a kernel that sums the squares in torch's own order
    (elementwise.c) and rounds where torch rounds, so it equals transformers' norm exactly,
    residual or not, in float32 and in bfloat16."""
    from models import kernels
    if kernels.available("cpu", dtype):
        pytest.skip("the AVX-512 kernel runs here (equal to summation order only)")
    torch.manual_seed(dim)
    x, r = torch.randn(6, dim, dtype=dtype) * 4, torch.randn(6, dim, dtype=dtype)
    w = torch.randn(dim, dtype=dtype)
    (y, h), (y_ref, h_ref) = both(monkeypatch, dtype, lambda: ops.rms_norm(x, w, 1e-5, r))
    assert torch.equal(y, y_ref) and torch.equal(h, h_ref)
    ours, ref = both(monkeypatch, dtype, lambda: ops.rms_norm(x, w, 1e-5))
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, dim", [(12, 64), (3, 128), (2, 16), (1, 8), (2, 40)])
def test_rope_in_place_on_a_strided_view(monkeypatch, dtype, heads, dim):
    torch.manual_seed(0)
    rows, extra = 9, 5                        # each row: heads * dim, then columns left alone
    base = torch.randn(rows, heads * dim + extra, dtype=dtype)
    cos_sin = torch.randn(50, dim, dtype=dtype)
    positions = torch.tensor([0, 49, 3, 3, 7, 1, 20, 30, 2])

    def run():
        buf = base.clone()
        out = ops.rope_(buf[:, :heads * dim].view(rows, heads, dim),
                        ops.Rotary(cos_sin, positions))
        assert out.data_ptr() == buf.data_ptr()
        return buf

    ours, ref = both(monkeypatch, dtype, run)
    assert torch.equal(ours[:, heads * dim:], base[:, heads * dim:])
    assert_same(ours, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, dim, rotary", [(4, 16, 12), (3, 128, 96), (2, 64, 2)])
def test_partial_rope_is_transformers_phi3(dtype, heads, dim, rotary):
    """A table narrower than the head (Phi-3's partial rotary) rotates the leading `rotary`
    dims of each head and leaves the rest: transformers' Phi-3 apply_rotary_pos_emb, bit
    for bit (torch on both sides: the kernel rotates whole heads only), on q and k side by
    side in one view as the model passes them."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb
    torch.manual_seed(0)
    rows = 9
    qk = torch.randn(rows, 2 * heads * dim, dtype=dtype)
    half = torch.randn(50, rotary // 2, dtype=dtype)
    cos_sin = torch.cat((half.cos(), half.sin()), dim=-1)
    positions = torch.tensor([0, 49, 3, 3, 7, 1, 20, 30, 2])
    ours = qk.clone()
    ops.rope_(ours.view(rows, 2 * heads, dim), ops.Rotary(cos_sin, positions))
    cos, sin = (torch.cat((t, t), dim=-1)[positions][None] for t in cos_sin.chunk(2, dim=-1))
    q, k = (t.view(1, rows, heads, dim).transpose(1, 2) for t in qk.chunk(2, dim=-1))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    want = torch.cat([t.transpose(1, 2).reshape(rows, heads * dim) for t in (q, k)], dim=-1)
    assert torch.equal(ours, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 1536), (33, 40), (2, 7)])
def test_silu_and_mul(monkeypatch, dtype, rows, inter):
    torch.manual_seed(0)
    gate_up = torch.randn(rows, 2 * inter, dtype=dtype) * 4
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])      # exp's clamps, and zero
    ours, ref = both(monkeypatch, dtype, lambda: ops.silu_and_mul(gate_up))
    assert_same(ours, ref, dtype, max_diff_fraction=0.02)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_propagates_like_torch(monkeypatch, dtype):
    """A NaN (a numerical blow-up upstream) must stay visible, not be clamped away."""
    gate_up = torch.randn(2, 32, dtype=dtype)
    gate_up[1, 3] = float("nan")
    ours, ref = both(monkeypatch, dtype, lambda: ops.silu_and_mul(gate_up))
    assert torch.equal(ours.isnan(), ref.isnan()) and ours.isnan().any()
