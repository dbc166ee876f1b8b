"""QuantLinear: a linear layer whose weight stays in GGUF's blocks in memory, run by our C
kernels (and QuantEmbedding, its lookup; QuantExperts, a mixture of experts' stacks, each
expert's projections a block matrix of its own): kernels/blocks.c (float activations, every type below) and kernels/quant.c (x
rounded to int8 per block, as llama.cpp does; every type but Q2_K and Q3_K).

The weight is the file's own bytes: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL (blocks of 32),
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS (blocks of 256); or, for --quantization int8, Q8_0
blocks made at load from a float checkpoint (`quantize_q8_0`). The loader keeps
KEPT_TYPES in blocks. A decode step reads 2.6 to
8.5 bits per weight instead of 32 (float32) or 16 (bfloat16). A fused layer whose GGUF
tensors differ in type (Q4_K_M: q and k in Q4_K, v in Q6_K) keeps each part in its own
type: the layer is up to MAX_PARTS parts of consecutive output rows (blocks.c:
zs_linear_parts), so its memory is the file's.

Which kernel multiplies (one rule, in blocks.c's zs_linear_parts, for this module and for
decode.c alike):
- blocks.c, float activations: x times the weights as they are, each block dequantized in
  registers (a row of x alone: each sub-block's scale applied to its sum, blocks.c's
  header). The output is the dequantized layer's up to float32 rounding, so greedy output
  is the dequantized model's. Every type at every M, except:
- quant.c, x rounded to int8 per block of 32 (relative ~1e-3 of a typical output), for
  parts of INT8_TYPES (all but Q2_K and Q3_K) in model steps that run at least
  `int8_batch` requests together (--int8-activation-batch, default INT8_BATCH = 32: large
  batches, llama.cpp's arithmetic). The batch is the step's number of requests
  (`step_batch`, which the scheduler's runner sets around each step; M rows of x for a
  call outside a step), so a
  request served alone, or with a few others, is the dequantized model's whatever its
  prompt's length: a 37-token chat prompt prefilled in int8 and decoded in float turned
  the default model's "Paris" into a list of French words. quant.c's integer multiply-adds
  take four pairs a lane where float takes one: on AVX2 about twice as fast a row from 8
  rows of x on, and 1.3x at one row (0.036 against 0.046 ns a Q4_1 weight, two cores).
Every part is kept regrouped 8 output rows at a time (`regroup`: the file's bytes, reordered
so that each weight's 8 rows load into the 8 lanes of one vector); for quant.c's types
(INT8_TYPES) quant.c reads that layout too, so one copy serves both kernels.

x and y are float32 for the kernels; another model dtype (bfloat16) is cast around them.
Only where kernels.avx2_available(cpu); elsewhere the loader dequantizes (loader.py).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from models import kernels
from models.moe import Experts
from wire.server_args import INT8_BATCH   # the batch from which INT8_TYPES take quant.c

# ggml type name -> (gguf.GGMLQuantizationType value, weights per block, bytes per block)
BLOCK_TYPES = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22),
               "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34), "IQ4_NL": (20, 32, 18),
               "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144),
               "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210), "IQ4_XS": (23, 256, 136)}
INT8_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL",      # quant.c's too
              "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
# What the loader keeps in blocks: every type blocks.c serves (each has a vectorized path).
KEPT_TYPES = tuple(BLOCK_TYPES)
MAX_PARTS = 3                            # blocks.c: ZS_MAX_PARTS
BLOCK = 32                               # quant.c's block


def row_bytes(qtype: str, in_features: int) -> int:
    _, values, size = BLOCK_TYPES[qtype]
    return in_features // values * size


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float -> uint8 [N, K/32 * 34]: Q8_0 blocks (llama.cpp's rounding, through the
    gguf library's numpy quantizer). K must be a multiple of 32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    blocks = quantize(weight.detach().float().cpu().numpy(), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.ascontiguousarray(blocks))


# Each type's block as fields (byte offset, size), as blocks.c's FIELDS (tests/test_blocks.py
# holds the two together: regroup here, ungroup there, gguf's values back).
FIELDS = {"Q4_0": ((0, 2), (2, 16)), "IQ4_NL": ((0, 2), (2, 16)),
          "Q4_1": ((0, 2), (2, 2), (4, 16)), "Q5_0": ((0, 2), (2, 4), (6, 16)),
          "Q5_1": ((0, 2), (2, 2), (4, 4), (8, 16)), "Q8_0": ((0, 2), (2, 32)),
          "Q2_K": ((0, 16), (16, 64), (80, 2), (82, 2)),
          "Q3_K": ((0, 32), (32, 64), (96, 12), (108, 2)),
          "Q4_K": ((0, 2), (2, 2), (4, 12), (16, 128)),
          "Q5_K": ((0, 2), (2, 2), (4, 12), (16, 32), (48, 128)),
          "Q6_K": ((0, 128), (128, 64), (192, 16), (208, 2)),
          "IQ4_XS": ((0, 2), (2, 2), (4, 4), (8, 128))}


QH_AT = {"Q5_0": 2, "Q5_1": 4}           # where a Q5 block's uint32 of fifth bits is


def qh_bit(p: int) -> int:
    """Where regroup keeps bit p of a Q5 block's qh (blocks.c: QH_BIT)."""
    return 8 * (p % 4) + (p % 16) // 4 + 4 * (p // 16)


def regroup(qtype: str, blocks: torch.Tensor) -> torch.Tensor:
    """GGUF rows of blocks, uint8 [N, bytes per row] -> groups of 8 rows (N padded with zero
    rows to a multiple of 8), flat uint8, the same bytes reordered: a group's blocks in
    order, each block's fields one after another, a field of B bytes as B / w units of w
    bytes (w = 2 for the fp16 scales, else 4) with unit c of rows 0..7 side by side. For
    INT8_TYPES quant.c reads this layout too (its comments), so one copy serves both
    kernels; blocks.c reads every type from it (blocks_impl.h). One exception to "the
    same bytes": a Q5_0 / Q5_1 block's 32 fifth bits are reordered within their uint32
    (qh_bit), so that blocks.c finds a unit's eight beside its nibbles."""
    n, row = blocks.shape
    size = BLOCK_TYPES[qtype][2]
    nb, pad = row // size, -n % 8
    b = torch.cat([blocks, blocks.new_zeros(pad, row)]).view(-1, 8, nb, size)
    if qtype in QH_AT:                       # Q5's fifth bits in blocks.c's order: QH_BIT
        at = QH_AT[qtype]
        qh = b[..., at:at + 4].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        held = torch.zeros_like(qh)
        for p in range(32):
            held |= ((qh >> p) & 1) << qh_bit(p)
        b = b.clone()
        b[..., at:at + 4] = held.to(torch.int32).view(torch.uint8).view(*held.shape[:-1], 4)
    fields = []
    for off, width in FIELDS[qtype]:
        w = 2 if width == 2 else 4
        f = b[..., off:off + width].reshape(-1, 8, nb, width // w, w).permute(0, 2, 3, 1, 4)
        fields.append(f.reshape(-1, nb, 8 * width))              # [groups, nb, units*8*w]
    return torch.cat(fields, dim=-1).contiguous().view(-1)


def dequantize(qtype: str, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """The float32 [N, K] weight the blocks stand for (the gguf library's dequantizer)."""
    from gguf.quants import dequantize as gguf_dequantize

    out = gguf_dequantize(blocks.numpy(), BLOCK_TYPES[qtype][0])
    return torch.from_numpy(np.ascontiguousarray(out)).reshape(-1, in_features)


# What a decode step of R rows costs on the CPU, in one-row steps: FIXED (embedding,
# sampling, the Python around the step) plus one pass over the weights per tile of rows
# (blocks.c and linear.c take x's rows in tiles of 8, 4, 2 and 1), TILE_PASS[tile] each.
# Fitted to decode steps of the default model (Q4_1 layers on blocks.c) on a 2-core
# AVX-512 machine: 1, 2, 3, 4, 5, 8, 9, 16 rows took 1.0, 1.1, 2.0, 1.32, 2.4, 2.37, 2.85,
# 3.97 steps (docs/performance.md, "Speculative decoding"). Speculative decoding's policy
# reads it (scheduler_proc/speculative.py).
FIXED = 0.3
TILE_PASS = {8: 2.0, 4: 1.02, 2: 0.8, 1: 0.7}


def cpu_step_cost(rows: int) -> float:
    """A CPU decode step of `rows` rows, in one-row steps (TILE_PASS)."""
    cost = FIXED
    for tile, one_pass in TILE_PASS.items():
        n, rows = divmod(rows, tile)
        cost += n * one_pass
    return cost


@contextlib.contextmanager
def step_batch(requests: int):
    """Inside, the kernel rule (module doc) takes `requests` (a model step's) as the batch
    of every quantized layer called, instead of its rows of x."""
    lib = kernels.library()
    if lib is None:
        yield
        return
    lib.zs_set_step_batch(requests)
    try:
        yield
    finally:
        lib.zs_set_step_batch(0)


class _Part(ctypes.Structure):            # blocks.c: ZsPart
    _fields_ = [("type", ctypes.c_int64), ("int8", ctypes.c_int64),
                ("rows", ctypes.c_int64), ("weight", ctypes.c_void_p)]


class _Blocks(ctypes.Structure):          # blocks.c: ZsBlocks
    _fields_ = [("nparts", ctypes.c_int64), ("avx512", ctypes.c_int64),
                ("int8_batch", ctypes.c_int64), ("vnni", ctypes.c_int64),
                ("part", _Part * MAX_PARTS)]


def _c_blocks(parts: Sequence[tuple[str, int, int]], int8_batch: int) -> _Blocks:
    """blocks.c's description (ZsBlocks) of a layer of `parts`: (type, rows, the address of
    its regrouped blocks) each, in output row order, under the kernel rule (module doc)."""
    c = _Blocks(len(parts), int(kernels.available("cpu", torch.float32)), int8_batch,
                int(kernels.vnni_available("cpu")))
    for i, (t, rows, address) in enumerate(parts):
        c.part[i] = _Part(BLOCK_TYPES[t][0], int(t in INT8_TYPES), rows, address)
    return c


def _merged(qtypes: Sequence[str], blocks: Sequence[torch.Tensor]):
    """Consecutive parts of one type as one part."""
    out: list[tuple[str, list[torch.Tensor]]] = []
    for qtype, b in zip(qtypes, blocks):
        if out and out[-1][0] == qtype:
            out[-1][1].append(b)
        else:
            out.append((qtype, [b]))
    return [(qtype, bs[0] if len(bs) == 1 else torch.cat(bs)) for qtype, bs in out]


class QuantLinear(nn.Module):
    """y = x W^T + b with W as GGUF blocks: `qtype` and `blocks` (uint8 [rows, bytes per
    row], the file's rows) for one part, or sequences of them for the parts of a fused
    layer, in output row order. The blocks are non-persistent buffers (the state dict holds
    only the bias, which the loader fills like any other parameter). int8_batch: the rule's
    threshold (module doc); 1 takes quant.c always, a huge value never (for tests and
    comparisons)."""

    def __init__(self, qtype: str | Sequence[str], blocks: torch.Tensor | Sequence[torch.Tensor],
                 in_features: int, bias: torch.Tensor | None = None,
                 int8_batch: int = INT8_BATCH):
        super().__init__()
        qtypes = [qtype] if isinstance(qtype, str) else list(qtype)
        blocks = [blocks] if isinstance(blocks, torch.Tensor) else list(blocks)
        parts = _merged(qtypes, blocks)
        if len(parts) > MAX_PARTS:
            raise ValueError(f"QuantLinear takes at most {MAX_PARTS} parts of different "
                             f"types, got {[t for t, _ in parts]}")
        self.in_features, self.out_features = in_features, sum(b.shape[0] for _, b in parts)
        self.qtype = "+".join(t for t, _ in parts)
        self.parts: list[tuple[str, int]] = []             # (type, rows) of each part
        for i, (t, b) in enumerate(parts):
            if t not in BLOCK_TYPES:
                raise ValueError(f"QuantLinear serves {sorted(BLOCK_TYPES)}, not {t}")
            if in_features % BLOCK_TYPES[t][1] or b.dim() != 2 or b.dtype != torch.uint8 \
                    or b.shape[1] != row_bytes(t, in_features):
                raise ValueError(f"{t} weight blocks {tuple(b.shape)} {b.dtype} do not fit "
                                 f"{in_features} input features")
            self.register_buffer(f"blocks_{i}", regroup(t, b), persistent=False)
            self.parts.append((t, b.shape[0]))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.int8_batch = int8_batch
        self._kernel = kernels.library().zs_linear_parts
        self._c: _Blocks | None = None           # c_blocks(), built on first use
        self._bias_call: tuple | None = None     # (fused bias pointer, bias added after)

    def c_blocks(self) -> int:
        """The address of blocks.c's description of this layer (ZsBlocks: its parts and the
        kernel rule, module doc), built on the first call, when the buffers are where they
        stay."""
        if self._c is None:
            self._c = _c_blocks([(t, rows, getattr(self, f"blocks_{i}").data_ptr())
                                 for i, (t, rows) in enumerate(self.parts)], self.int8_batch)
        return ctypes.addressof(self._c)

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
        if self._bias_call is None:     # once: the loader assigns the bias after __init__
            bias = self.bias
            fused = bias is None or bias.dtype == torch.float32
            self._bias_call = (None if bias is None or not fused else bias.data_ptr(),
                               None if fused else bias)
        b, after = self._bias_call
        m = x.shape[0]
        if m and self._kernel(self.c_blocks(), x.data_ptr(), m, self.in_features, b,
                              y.data_ptr()):
            raise MemoryError(f"QuantLinear: no memory for the scratch copies of {m} rows")
        if after is not None:
            y += after


class QuantEmbedding(nn.Module):
    """An embedding whose table stays in GGUF's blocks: `forward(ids)` dequantizes just the
    rows it looks up (blocks.c: zs_dequant_rows, bit for bit gguf's values), in the model
    dtype. The table is its own (the file's rows of one type) or, for a tied LM head, the
    head's QuantLinear's one-part buffer (`of_head`): one copy serves the lookup and the
    logits. No float copy of the table is ever made."""

    def __init__(self, qtype: str, blocks: torch.Tensor, embedding_dim: int,
                 dtype: torch.dtype, rows: int | None = None):
        """blocks: GGUF rows [N, bytes per row], or (rows given) an already regrouped table
        of that many rows."""
        super().__init__()
        if qtype not in BLOCK_TYPES or embedding_dim % BLOCK_TYPES[qtype][1]:
            raise ValueError(f"QuantEmbedding: {qtype} rows of {embedding_dim} values")
        self.qtype, self.embedding_dim, self.dtype = qtype, embedding_dim, dtype
        self.num_embeddings = blocks.shape[0] if rows is None else rows
        self.register_buffer("blocks", blocks if rows is not None else regroup(qtype, blocks),
                             persistent=False)
        lib = kernels.library()
        self._kernel = (lib.zs_dequant_rows_avx512 if kernels.available("cpu", torch.float32)
                        else lib.zs_dequant_rows_avx2)

    @classmethod
    def of_head(cls, head: QuantLinear, dtype: torch.dtype) -> "QuantEmbedding":
        """The lookup of a tied model, on its LM head's blocks (one part)."""
        (qtype, rows), = head.parts
        return cls(qtype, head.blocks_0, head.in_features, dtype, rows=rows)

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty((flat.shape[0], self.embedding_dim), dtype=torch.float32)
        if flat.numel() and self._kernel(BLOCK_TYPES[self.qtype][0],
                                         self.blocks.data_ptr(), self.num_embeddings,
                                         self.embedding_dim, flat.data_ptr(), flat.shape[0],
                                         out.data_ptr()):
            raise IndexError(f"QuantEmbedding: an id outside [0, {self.num_embeddings})")
        out = out.view(*ids.shape, self.embedding_dim)
        return out if self.dtype == torch.float32 else out.to(self.dtype)


class QuantExperts(Experts):
    """A mixture of experts' stacked weights kept in GGUF's blocks (moe.Experts' grouped
    forward unchanged): `gate_up(e, x)` and `down(e, h)` are one blocks.c call each, on
    expert e's rows of the file's stacked tensors, under the kernel rule of the module doc
    (in a model step the step's requests decide, as for every layer; a direct call, the
    expert's own rows). The experts of a layer share their types (one GGUF tensor holds
    them all): each expert's gate_up is two parts (its gate rows, then its up rows, as in
    the float stack), its down one. Each stack is regrouped (8 rows at a time, `regroup`) into
    one buffer, [E, bytes per expert], row e expert e's: the file's memory, no float
    copy. Router and routing stay moe.py's, in float."""

    def __init__(self, gate: tuple[str, torch.Tensor], up: tuple[str, torch.Tensor],
                 down: tuple[str, torch.Tensor], hidden_size: int,
                 int8_batch: int = INT8_BATCH):
        """gate, up: (type, uint8 [E, I, bytes per row of hidden_size]); down: (type, uint8
        [E, hidden_size, bytes per row of I]): the GGUF tensors' own bytes."""
        nn.Module.__init__(self)                        # no float stacks: the blocks instead
        (gate_type, gate_b), (up_type, up_b), (down_type, down_b) = gate, up, down
        experts, inter = gate_b.shape[:2]
        self.num_experts, self.hidden_size, self.intermediate_size = experts, hidden_size, inter
        for name, t, b, rows, width in (("gate", gate_type, gate_b, inter, hidden_size),
                                        ("up", up_type, up_b, inter, hidden_size),
                                        ("down", down_type, down_b, hidden_size, inter)):
            if t not in BLOCK_TYPES:
                raise ValueError(f"QuantExperts serves {sorted(BLOCK_TYPES)}, not {t}")
            if width % BLOCK_TYPES[t][1] or b.dtype != torch.uint8 or \
                    tuple(b.shape) != (experts, rows, row_bytes(t, width)):
                raise ValueError(f"{t} {name} expert blocks {tuple(b.shape)} {b.dtype} do "
                                 f"not fit {experts} experts of {rows} rows of {width}")
            # One regroup of the whole stack: an expert's rows (I or hidden_size, each the
            # input width of another of its projections, so a multiple of 32) fill whole
            # groups of 8, so no group straddles two experts and expert e's groups are
            # regroup(t, b[e]), row e of the buffer.
            self.register_buffer(f"{name}_blocks",
                                 regroup(t, b.reshape(experts * rows, -1)).view(experts, -1),
                                 persistent=False)
        self.types = (gate_type, up_type, down_type)
        up_part = "" if up_type == gate_type else f"+{up_type}"
        self.qtype = f"{gate_type}{up_part} / {down_type}"     # describe_weights' form
        self.int8_batch = int8_batch
        self._kernel = kernels.library().zs_linear_parts
        self._c: tuple[list[_Blocks], list[_Blocks]] | None = None   # built on first use

    def extra_repr(self) -> str:
        return (f"{self.num_experts} experts, {self.hidden_size} -> "
                f"{self.intermediate_size} -> {self.hidden_size}, {self.qtype}")

    def _descriptions(self) -> tuple[list[_Blocks], list[_Blocks]]:
        """Each expert's gate_up and down as blocks.c layers (built once, on first use,
        when the buffers are where they stay)."""
        if self._c is None:
            gate_type, up_type, down_type = self.types
            i, h = self.intermediate_size, self.hidden_size
            at = {n: (getattr(self, f"{n}_blocks").data_ptr(),
                      getattr(self, f"{n}_blocks").stride(0)) for n in ("gate", "up", "down")}
            self._c = ([_c_blocks([(gate_type, i, at["gate"][0] + e * at["gate"][1]),
                                   (up_type, i, at["up"][0] + e * at["up"][1])],
                                  self.int8_batch) for e in range(self.num_experts)],
                       [_c_blocks([(down_type, h, at["down"][0] + e * at["down"][1])],
                                  self.int8_batch) for e in range(self.num_experts)])
        return self._c

    def gate_up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(self._descriptions()[0][e], x, 2 * self.intermediate_size)

    def down(self, e: int, h: torch.Tensor) -> torch.Tensor:
        return self._matmul(self._descriptions()[1][e], h, self.hidden_size)

    def _matmul(self, c: _Blocks, x: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] (the model's dtype, on the CPU) times one expert's blocks -> [M, n]."""
        x32 = x.to(torch.float32).contiguous()
        y = torch.empty((x32.shape[0], n), dtype=torch.float32)
        if x32.shape[0] and self._kernel(ctypes.addressof(c), x32.data_ptr(), x32.shape[0],
                                         x32.shape[1], None, y.data_ptr()):
            raise MemoryError(f"QuantExperts: no memory for the scratch copies of "
                              f"{x32.shape[0]} rows")
        return y if x.dtype == torch.float32 else y.to(x.dtype)
