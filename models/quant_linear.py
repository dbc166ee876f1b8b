"""QuantLinear: a linear layer whose weight stays quantized in memory, run by kernels/quant.c.

The weight is GGUF's own blocks of 32 (Q8_0, Q4_0 or Q4_1; quant.c gives the layouts): the
bytes of the file, regrouped 8 output rows at a time so that the kernel computes 8 outputs
per vector (or, for --quantization int8, Q8_0 blocks made at load from a float checkpoint:
`quantize_q8_0`). A decode step reads 8.5 bits (Q8_0), 4.5 (Q4_0) or 5 (Q4_1) per weight
instead of 32 (float32) or 16 (bfloat16): the single-stream decode that is bound by memory
bandwidth reads 2-7x fewer bytes.

x is quantized to int8 per block of 32 inside the kernel, as llama.cpp does: outputs differ
from dequantize-then-matmul by x's rounding only (relative ~1e-3 of a typical output).
x and y are float32 for the kernel; another model dtype (bfloat16) is cast around it.
Only where kernels.avx2_available(cpu); elsewhere the loader dequantizes (loader.py).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from models import kernels

# ggml type name -> (gguf.GGMLQuantizationType value, bytes per block of 32 weights)
BLOCK_TYPES = {"Q8_0": (8, 34), "Q4_0": (2, 18), "Q4_1": (3, 20)}
BLOCK = 32


def row_bytes(qtype: str, in_features: int) -> int:
    return in_features // BLOCK * BLOCK_TYPES[qtype][1]


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float -> uint8 [N, K/32 * 34]: Q8_0 blocks (llama.cpp's rounding, through the
    gguf library's numpy quantizer). K must be a multiple of 32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    blocks = quantize(weight.detach().float().cpu().numpy(), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.ascontiguousarray(blocks))


def interleave(qtype: str, blocks: torch.Tensor) -> torch.Tensor:
    """GGUF rows of blocks, uint8 [N, K/32 * block bytes] -> quant.c's groups of 8 rows
    (quant.c says how; N is padded with zero rows to a multiple of 8), flat uint8."""
    n, row = blocks.shape
    size = BLOCK_TYPES[qtype][1]
    nb, pad = row // size, -n % 8
    b = torch.cat([blocks, blocks.new_zeros(pad, row)]).view(-1, 8, nb, size)
    head = 4 if qtype == "Q4_1" else 2                    # bytes of scale (and min)
    scales = b[..., :head].view(-1, 8, nb, head // 2, 2).permute(0, 2, 3, 1, 4)  # [G,nb,s,8,2]
    quads = b[..., head:].reshape(-1, 8, nb, (size - head) // 4, 4).permute(0, 2, 3, 1, 4)
    return torch.cat([scales.reshape(-1, nb, head * 8), quads.reshape(-1, nb, (size - head) * 8)],
                     dim=-1).contiguous().view(-1)


def dequantize(qtype: str, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """The float32 [N, K] weight the blocks stand for (the gguf library's dequantizer)."""
    from gguf.quants import dequantize as gguf_dequantize

    out = gguf_dequantize(blocks.numpy(), BLOCK_TYPES[qtype][0])
    return torch.from_numpy(np.ascontiguousarray(out)).reshape(-1, in_features)


class QuantLinear(nn.Module):
    """y = x W^T + b with W as quantized blocks: given as GGUF rows of blocks, kept
    regrouped 8 rows at a time (interleave). `blocks` is a non-persistent buffer (the state
    dict holds only the bias, which the loader fills like any other parameter)."""

    def __init__(self, qtype: str, blocks: torch.Tensor, in_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        if qtype not in BLOCK_TYPES:
            raise ValueError(f"QuantLinear serves {sorted(BLOCK_TYPES)}, not {qtype}")
        if in_features % BLOCK or blocks.dim() != 2 or blocks.dtype != torch.uint8 \
                or blocks.shape[1] != row_bytes(qtype, in_features):
            raise ValueError(f"{qtype} weight blocks {tuple(blocks.shape)} {blocks.dtype} do "
                             f"not fit {in_features} input features")
        self.qtype, self.in_features, self.out_features = qtype, in_features, blocks.shape[0]
        self.register_buffer("blocks", interleave(qtype, blocks), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._type_id = BLOCK_TYPES[qtype][0]
        self._kernel = kernels.library().zs_linear_quant
        self._call: tuple | None = None          # the kernel's fixed arguments (_run)
        self._bias_after: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.qtype}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, in_features] (or [..., in_features]) on the CPU -> [..., out_features].
        The model's case, a contiguous float32 [M, K], takes the shortest path: this runs
        ~120 times per decode step, and each torch call here costs microseconds."""
        if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous() \
                and x.shape[1] == self.in_features and x.device.type == "cpu":
            y = torch.empty((x.shape[0], self.out_features), dtype=torch.float32)
            self._run(x, y)
            return y
        if x.shape[-1] != self.in_features or x.device.type != "cpu":
            raise ValueError(f"QuantLinear({self.in_features} -> {self.out_features}) got "
                             f"{tuple(x.shape)} on {x.device}")
        x2 = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        y = torch.empty((x2.shape[0], self.out_features), dtype=torch.float32)
        self._run(x2, y)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def _run(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """The kernel on float32 x [M, K] -> y [M, N], both contiguous."""
        if self._call is None:      # once: the loader assigns the bias after __init__
            bias = self.bias
            fused = bias is None or bias.dtype == torch.float32
            self._bias_after = None if fused else bias
            self._call = (self._type_id, self.in_features, self.blocks.data_ptr(),
                          self.out_features, None if bias is None or not fused
                          else bias.data_ptr())
        t, k, w, n, b = self._call
        m = x.shape[0]
        if m and self._kernel(t, x.data_ptr(), m, k, w, n, b, y.data_ptr()):
            raise MemoryError(f"QuantLinear: no memory for the int8 copy of {m} rows")
        if self._bias_after is not None:
            y += self._bias_after
