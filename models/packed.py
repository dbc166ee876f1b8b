"""PackedLinear: linear layers whose weights oneDNN re-lays-out once, at load time, for CPU.

The fallback where our own kernel (cpu_linear.py) cannot run: no AVX-512 (AVX512_BF16 for
bfloat16), no C compiler, or ZSERVE_CPU_KERNELS=0. Where oneDNN cannot pack a dtype either
(bfloat16 without AVX-512), the model keeps torch's plain nn.Linear.

On this class of CPU the packed GEMM is about 2x faster than F.linear (MKL) in float32 at
the shapes of a decode step (M = 32 rows, K = 576: 67 -> 34 ms for a 135M model's MLPs),
1.5x at M = 1, and 5-25% faster in bfloat16, with bfloat16 results bit-identical. In
float32 the sums run in another order (relative differences ~1e-6). The packed tensor
replaces the plain weight, so memory does not grow (except a tied LM head, which needs
its own packed copy of the embedding).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

PACK_BATCH_HINT = 32      # rows oneDNN tunes the layout for; measured to matter little
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in PACKABLE_DTYPES
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and _packs(dtype))


@functools.cache
def _packs(dtype: torch.dtype) -> bool:
    """oneDNN packs bfloat16 only on CPUs with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT and
    says so by raising: probe once with a small weight instead of guessing from flags."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype),
                                                PACK_BATCH_HINT)
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(
            weight.detach(), PACK_BATCH_HINT), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, in_features] -> [N, out_features]."""
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

