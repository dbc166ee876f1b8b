"""CpuLinear: linear layers on zserve's own AVX-512 kernel (kernels/linear.c), for the CPU.

One weight layout, panels of 16 output rows (see linear.c), serves every batch size: the
kernel streams the weights once per call and keeps a tile of 8 rows x 48 outputs in
registers. Against oneDNN's packed weights (PackedLinear, the fallback) on the 135M shape,
2 threads, per call: 1.5-3x faster at M = 1 (the matrix-vector product of single-stream
decode, which oneDNN runs at half the memory bandwidth), 1.1-1.4x at M = 32, even at
M = 256. Sums run in another order than F.linear's: float32 outputs differ in rounding
(~1e-6), and bfloat16 ones are identical but for ~0.1% that round to the other side of a
tie (one ulp).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from models import kernels

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


class CpuLinear(nn.Module):
    """Only where kernels.linear_available(cpu, weight.dtype)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(to_panels(weight.detach()), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().contiguous(),
                                                           requires_grad=False)
        self.dtype = weight.dtype               # of x, y and the bias
        lib = kernels.library()
        self.avx512 = kernels.available("cpu", weight.dtype)   # else linear.c's AVX2 version
        if self.avx512:
            self._kernel = (lib.zs_linear_f32 if weight.dtype == torch.float32
                            else lib.zs_linear_bf16)
        else:
            self._kernel = functools.partial(lib.zs_linear_avx2,
                                             int(weight.dtype == torch.bfloat16))

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
