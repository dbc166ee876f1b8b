"""The decoder's elementwise ops, each in one place: torch (any device) or, on CPUs where
kernels.available() or kernels.avx2_available() (float32, bfloat16), zserve's C kernels
(kernels/elementwise.c), which round exactly where the torch code below does, so the two
agree to float32 summation order.

    rms_norm(x, w, eps)               -> y
    rms_norm(x, w, eps, residual)     -> (y, h)  with h = x + residual, y = rms_norm(h)
    rope_(x, Rotary(cos_sin, positions))  rotates x [N, heads, D] in place (heads contiguous);
                                      a table narrower than D (partial rotary) rotates the
                                      leading dims only, in torch
    silu_and_mul(gate_up)             -> silu(gate) * up, gate_up = [gate | up] on the last dim
    gelu_tanh_and_mul(gate_up)        -> gelu_tanh(gate) * up (Gemma's GeGLU; torch only)
    ACT_AND_MUL[config.hidden_act]    -> the one of the two a model's MLP runs
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from models import kernels


class Kernels(NamedTuple):
    """The three C functions for one dtype, each taking elementwise.c's arguments without
    the leading dtype flag."""
    add_rms_norm: Callable
    rope: Callable
    silu_mul: Callable


@functools.cache
def _kernels_for(device_type: str, dtype: torch.dtype) -> Kernels | None:
    fns = [kernels.function(name, device_type, dtype)
           for name in ("zs_add_rms_norm", "zs_rope", "zs_silu_mul")]
    return None if fns[0] is None else Kernels(*fns)


def _kernel(x: Tensor) -> Kernels | None:
    """Our kernels for x's device and dtype, else None (torch)."""
    return _kernels_for(x.device.type, x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    """transformers' LlamaRMSNorm: x / rms(x) in float32, cast back, then scaled in the
    model dtype. With a residual, normalizes h = x + residual and returns (y, h)."""
    lib = _kernel(x)
    if (lib is None or weight.dtype != x.dtype or x.shape[-1] < 8    # (under 8, torch
            or (residual is not None and residual.dtype != x.dtype)):   # sums in other orders)
        h = x if residual is None else x + residual
        hf = h.float()
        hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        y = weight * hf.to(h.dtype)
        return y if residual is None else (y, h)
    d = x.shape[-1]
    flat = x.dim() == 2                         # the model's case: skip the views (~2 us each)
    x2 = x.contiguous() if flat else x.reshape(-1, d).contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype)
    h = r = None
    if residual is not None:
        r = residual.contiguous() if flat else residual.reshape(-1, d).contiguous()
        h = torch.empty(x2.shape, dtype=x.dtype)
    lib.add_rms_norm(x2.data_ptr(), None if r is None else r.data_ptr(),
                     None if h is None else h.data_ptr(), weight.data_ptr(), eps, x2.shape[0],
                     d, y.data_ptr())
    if not flat:
        y, h = y.view(x.shape), None if h is None else h.view(x.shape)
    return y if residual is None else (y, h)


class Rotary:
    """One step's RoPE inputs, built once per forward: the [max_positions, R] table (cos in
    the first half, sin in the second, in the model dtype; rope.py builds it; R: the rotated
    dims, the head dim D or less) and the [N] positions, each below
    max_positions (the kernel does not check: the launcher caps the context length). The
    torch path gathers the step's rows once, for every layer."""

    __slots__ = ("cos_sin", "positions", "_rows")

    def __init__(self, cos_sin: Tensor, positions: Tensor):
        self.cos_sin, self.positions = cos_sin, positions
        self._rows: tuple[Tensor, Tensor] | None = None

    def rows(self) -> tuple[Tensor, Tensor]:
        """cos, sin: [N, 1, R/2] each, broadcast over heads."""
        if self._rows is None:
            self._rows = self.cos_sin[self.positions].unsqueeze(1).chunk(2, dim=-1)
        return self._rows


def rope_(x: Tensor, rotary: Rotary) -> Tensor:
    """Rotate each (x[i], x[i + R/2]) pair of every head by its position's angle, in place:
    transformers' `x*cos + rotate_half(x)*sin` with the halves written out, on the first R
    dims of each head (R: the table's width; the rest, under partial rotary, stay as they are).
    x: [N, heads, D] (a view is fine if each row's heads are contiguous)."""
    n, heads, d = x.shape
    cos_sin, positions = rotary.cos_sin, rotary.positions
    lib = _kernel(x)
    if (lib is None or cos_sin.shape[-1] != d       # the kernel rotates whole heads
            or x.stride(2) != 1 or x.stride(1) != d or d % 2
            or cos_sin.dtype != x.dtype or not cos_sin.is_contiguous()
            or positions.dtype != torch.int64 or not positions.is_contiguous()):
        cos, sin = rotary.rows()
        rot = x if cos_sin.shape[-1] == d else x[..., :cos_sin.shape[-1]]
        x1, x2 = rot.chunk(2, dim=-1)
        rot.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
        return x
    lib.rope(x.data_ptr(), n, x.stride(0), heads, d, cos_sin.data_ptr(), positions.data_ptr())
    return x


def silu_and_mul(gate_up: Tensor) -> Tensor:
    lib = _kernel(gate_up)
    if lib is None or gate_up.dim() != 2:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    gu = gate_up.contiguous()
    m, i = gu.shape[0], gu.shape[1] // 2
    y = torch.empty((m, i), dtype=gu.dtype)
    lib.silu_mul(gu.data_ptr(), m, i, y.data_ptr())
    return y


def gelu_tanh_and_mul(gate_up: Tensor) -> Tensor:
    """transformers' gelu_pytorch_tanh(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


ACT_AND_MUL = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


# Decode attention over the paged KV pool (kernels/attention.c), for scheduler_proc/attention.py
# and fast_decode.py: the shapes it takes.
KERNEL_MAX_HEADS, KERNEL_HEAD_DIMS = 64, (32, 64, 128, 256)     # as in attention.c


@functools.cache
def _decode_function(device_type: str, dtype: torch.dtype):
    """attention.c's decode attention for this device and dtype, taking its arguments
    without the dtype flag (its AVX-512 kernel, else its AVX2 one), or None."""
    return kernels.function("zs_decode_attention", device_type, dtype)


# The KV pool dtypes it reads, under float32 or bfloat16 queries, by attention.c's number
# for each (KV_F32, KV_BF16, KV_I8); scheduler_proc/pool.py lays its buffers out by them.
KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def decode_kernel_fits(device: torch.device, dtype: torch.dtype, num_heads: int,
                       num_kv_heads: int, head_dim: int,
                       kv_dtype: torch.dtype | None = None) -> bool:
    """Can decode rows of this model (a KV pool of kv_dtype: default, the model's) run on
    kernels/attention.c?"""
    return (_decode_function(torch.device(device).type, dtype) is not None
            and (kv_dtype or dtype) in KV_KINDS
            and head_dim in KERNEL_HEAD_DIMS and num_heads % num_kv_heads == 0
            and num_heads <= KERNEL_MAX_HEADS)
