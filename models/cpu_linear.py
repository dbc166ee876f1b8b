"""CpuLinear: linear layers on zserve's own AVX-512 kernel (kernels/linear.c), for the CPU.

One weight layout, panels of 16 output rows (see linear.c), serves every batch size: the
kernel streams the weights once per call and keeps a tile of 8 rows x 48 outputs in
registers. Against oneDNN's packed weights (PackedLinear, the fallback) on the 135M shape,
2 threads, per call: 1.5-3x faster at M = 1 (the matrix-vector product of single-stream
decode, which oneDNN runs at half the memory bandwidth), 1.1-1.4x at M = 32, even at
M = 256. Sums run in another order than F.linear's: float32 outputs differ in rounding
(~1e-6), and bfloat16 ones are identical but for ~0.1% that round to the other side of a
tie (one ulp). A row's outputs do not depend on the other rows of the call.

CpuExperts: a mixture of experts' float stacks (moe.Experts) on the same kernel, each
expert's gate_up and down in panels, one call per chosen expert and projection (against
torch's F.linear on one expert's slice: 1.1-2.8x in float32 at 1-8 rows, 3-14x in
bfloat16, bench/README.md).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from models import kernels

from .moe import Experts

PANEL = 16                                   # output rows per panel


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> float32 [N/16, K, 16] or bfloat16 [N/16, K/2, 16, 2], zero-padded."""
    n, k = weight.shape
    padded_n = -(-n // PANEL) * PANEL
    w = F.pad(weight, (0, 0, 0, padded_n - n))
    if weight.dtype == torch.float32:
        return w.view(padded_n // PANEL, PANEL, k).transpose(1, 2).contiguous()
    w = F.pad(w, (0, k % 2))
    return w.view(padded_n // PANEL, PANEL, -1, 2).permute(0, 2, 1, 3).contiguous()


def _kernel(dtype: torch.dtype):
    """(AVX-512?, linear.c's function for dtype: its AVX-512 version, else its AVX2 one)."""
    lib = kernels.library()
    if kernels.available("cpu", dtype):
        return True, lib.zs_linear_f32 if dtype == torch.float32 else lib.zs_linear_bf16
    return False, functools.partial(lib.zs_linear_avx2, int(dtype == torch.bfloat16))


class CpuLinear(nn.Module):
    """Only where kernels.linear_available(cpu, weight.dtype)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(to_panels(weight.detach()), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().contiguous(),
                                                           requires_grad=False)
        self.dtype = weight.dtype               # of x, y and the bias
        self.avx512, self._kernel = _kernel(weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] in the weight's dtype -> [..., out_features]."""
        if x.dtype != self.dtype or x.shape[-1] != self.in_features or x.device.type != "cpu":
            raise ValueError(f"CpuLinear({self.in_features} -> {self.out_features}, "
                             f"{self.dtype}) got {tuple(x.shape)} {x.dtype} on {x.device}")
        flat = x.dim() == 2                     # the model's case: skip the views (~2 us each)
        x2 = x.contiguous() if flat else x.reshape(-1, self.in_features).contiguous()
        m = x2.shape[0]
        y = torch.empty((m, self.out_features), dtype=x.dtype)
        if m:
            self._kernel(x2.data_ptr(), m, self.in_features, self.weight.data_ptr(),
                         self.out_features, None if self.bias is None else self.bias.data_ptr(),
                         y.data_ptr())
        return y if flat else y.view(*x.shape[:-1], self.out_features)


class CpuExperts(Experts):
    """moe.Experts with each expert's gate_up [2I, H] and down [H, I] in linear.c's panels,
    stacked by expert (the parameters keep their names; moe.Experts' grouped forward is
    unchanged): `gate_up(e, x)` and `down(e, h)` are one kernel call on expert e's panels.
    Only where kernels.linear_available(cpu, dtype)."""

    def __init__(self, experts: Experts):
        """experts: consumed (its stacks become the panels where no padding is needed)."""
        nn.Module.__init__(self)
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        self.num_experts = gate_up.shape[0]
        self.dtype = gate_up.dtype
        self.gate_up_shape, self.down_shape = tuple(gate_up.shape[1:]), tuple(down.shape[1:])
        self.gate_up_proj = nn.Parameter(_stacked_panels(gate_up), requires_grad=False)
        self.down_proj = nn.Parameter(_stacked_panels(down), requires_grad=False)
        self.avx512, self._kernel = _kernel(self.dtype)

    def extra_repr(self) -> str:
        (i2, h) = self.gate_up_shape
        return f"{self.num_experts} experts, {h} -> {i2 // 2} -> {h}, {self.dtype}, panels"

    def gate_up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.gate_up_proj[e], *self.gate_up_shape)

    def down(self, e: int, h: torch.Tensor) -> torch.Tensor:
        return self._linear(h, self.down_proj[e], *self.down_shape)

    def _linear(self, x: torch.Tensor, panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """x [M, k] (the model's dtype, on the CPU: moe.Experts' rows) -> [M, n]."""
        x = x.contiguous()
        y = torch.empty((x.shape[0], n), dtype=self.dtype)
        if x.shape[0]:
            self._kernel(x.data_ptr(), x.shape[0], k, panels.data_ptr(), n, None, y.data_ptr())
        return y


def _stacked_panels(stack: torch.Tensor) -> torch.Tensor:
    """[E, N, K] (contiguous) -> [E, *to_panels' shape], one expert at a time. Where the
    panels need no padding (N a multiple of 16, and K even for bfloat16: the experts of
    every model we know) they are written over the stack itself, expert by expert: no
    second copy of the experts, which on a model of gigabytes costs seconds of page faults
    at startup (bench/README.md)."""
    shape = to_panels(stack[0]).shape
    if shape.numel() == stack[0].numel() and stack.is_contiguous():
        for e in range(stack.shape[0]):
            stack[e].view(-1).copy_(to_panels(stack[e]).view(-1))
        return stack.view(stack.shape[0], *shape)
    out = torch.empty((stack.shape[0], *shape), dtype=stack.dtype)
    for e in range(stack.shape[0]):
        out[e] = to_panels(stack[e])
    return out
