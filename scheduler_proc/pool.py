"""KV memory: a pool of token slots, the per-layer K/V buffers they index, and the
request-to-slots table (SGLang's token_to_kv_pool and req_to_token). The allocators
(TokenPool, ReqToToken) belong to the scheduler's KVManager; the buffers (KVCache) to the
ModelRunner, which reads the table KVManager gives it for each step.

Invariant (TokenPool): every slot 1..size is in exactly one place: the free list or handed
out (to one request or to the radix tree: kv_manager.py). Slot 0 is never handed out; it is
the padding slot that masked-out positions of the request table point at, so gathers never
index out of range.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from models.ops import KV_KINDS
from wire.messages import TableWrite


class TokenPool:
    """Allocator of KV slots. `can_allocate / allocate / free`; double frees are errors."""

    def __init__(self, size: int):
        self.size = size
        self._free = list(range(size, 0, -1))     # pop() hands out low slots first
        self._is_free = bytearray(size + 1)
        for s in self._free:
            self._is_free[s] = 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV pool exhausted: want {n} slots, {len(self._free)} free")
        out = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        for s in out:
            self._is_free[s] = 0
        return out

    def free(self, slots: list[int]) -> None:
        """Return owned slots. Checks everything before changing anything, so a bad call
        (a free slot, a repeat, slot 0, out of range) raises and leaves the pool intact."""
        if len(set(slots)) != len(slots):
            raise RuntimeError(f"slot freed twice in one call: {slots}")
        for s in slots:
            if not 0 < s <= self.size:
                raise RuntimeError(f"KV slot {s} is not in the pool [1, {self.size}]")
            if self._is_free[s]:
                raise RuntimeError(f"double free of KV slot {s}")
        for s in slots:
            self._is_free[s] = 1
        self._free.extend(slots)


# int8 K/V: one float32 scale per KV_BLOCK values of a head (llama.cpp's q8_0 block size).
KV_BLOCK = 32


class KVCache:
    """One buffer per layer of shape [size + 1, 2, num_kv_heads, head_dim]: a slot's K and V
    sit side by side, so one row gather fetches both (row 0: padding).

    The buffers hold `kv_dtype` (default: the model's `dtype`): float32, bfloat16 or int8.
    int8 (--kv-cache-dtype int8) keeps beside each layer's buffer its scales, [size + 1, 2,
    num_kv_heads, head_dim / KV_BLOCK] float32: a value reads back as int8 * scale
    (quantize_kv says how they are made). Reads (`gather`) give the model's dtype."""

    def __init__(self, num_layers: int, size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str,
                 kv_dtype: torch.dtype | None = None):
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        if self.kv_dtype == torch.int8 and head_dim % KV_BLOCK:
            raise ValueError(f"an int8 KV cache needs a head size divisible by {KV_BLOCK}; "
                             f"this model's is {head_dim}: use --kv-cache-dtype auto")
        device = torch.device(device)
        shape = (size + 1, 2, num_kv_heads, head_dim)
        self.kv = [zeros(shape, self.kv_dtype, device) for _ in range(num_layers)]
        self.scales: list[torch.Tensor] | None = None
        if self.kv_dtype == torch.int8:
            self.scales = [zeros((*shape[:3], head_dim // KV_BLOCK), torch.float32, device)
                           for _ in range(num_layers)]

    @property
    def kind(self) -> int | None:
        """attention.c's number for the buffers' element kind; None: torch only."""
        return KV_KINDS.get(self.kv_dtype)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        buf = self.kv[layer]
        for i, x in enumerate((k, v)):
            if self.scales is None:
                buf[:, i].index_copy_(0, slots, x.to(buf.dtype))
            else:
                q, scale = quantize_kv(x)
                buf[:, i].index_copy_(0, slots, q)
                self.scales[layer][:, i].index_copy_(0, slots, scale)

    def gather(self, layer: int, slots: torch.Tensor,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` (any shape S...): two [*S, num_kv_heads, head_dim] views in
        `dtype` (default: the model's), converted in one pass."""
        dtype = dtype or self.dtype
        flat = slots.reshape(-1)
        rows = self.kv[layer].index_select(0, flat)
        if self.scales is not None:
            scale = self.scales[layer].index_select(0, flat)
            rows = (rows.unflatten(-1, (-1, KV_BLOCK)).float() * scale[..., None]).flatten(-2)
        rows = rows.to(dtype)
        rows = rows.view(*slots.shape, *rows.shape[1:])
        return rows.select(-3, 0), rows.select(-3, 1)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Pool bytes a token takes in every layer, K and V (int8: with its scales)."""
        per_value = torch.empty((), dtype=dtype).element_size()
        values = 2 * num_layers * num_kv_heads * head_dim
        if dtype == torch.int8:
            return values + values // KV_BLOCK * 4
        return values * per_value


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (int8 [..., D], float32 scales [..., D / KV_BLOCK]): per block of KV_BLOCK
    values, scale = max |x| / 127 and q = x / scale rounded to nearest even (0 where the
    scale is 0; a NaN's block has a NaN scale and q = 0). The same bits as attention.c's
    quantize_block, which the kernel path writes with."""
    xb = x.float().unflatten(-1, (-1, KV_BLOCK))
    scale = xb.abs().amax(-1) / 127
    d = scale[..., None]
    q = torch.where(d > 0, xb / d, 0.0).round_().nan_to_num_(0.0).clamp_(-127, 127)
    return q.to(torch.int8).flatten(-2), scale


class ReqToToken:
    """Row r maps request r's positions to slots. Rows are handed out to running requests;
    unused entries stay 0 (the padding slot).

    `log`: None, or (tensor-parallel rank 0: ModelRunner.share_table) a list every write()
    is appended to, in order, so the followers can mirror the table; the runner drains it
    into each step's plan. Frees are not logged (runner.py says why none is needed)."""

    def __init__(self, max_reqs: int, context_len: int, device: torch.device | str):
        self.size = max_reqs
        self.table = torch.zeros((max_reqs, context_len), dtype=torch.int64, device=device)
        # On CPU, writes go through a NumPy view of the table: ~1 us a write instead of ~15
        # for a tensor built from the list (a decode step writes once per running request).
        self._host = self.table.numpy() if self.table.device.type == "cpu" else None
        self._free_rows = list(range(max_reqs - 1, -1, -1))
        self.log: list[TableWrite] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def allocate(self) -> int:
        if not self._free_rows:
            raise MemoryError("no free row in the request-to-token table")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        if row in self._free_rows:
            raise RuntimeError(f"double free of request row {row}")
        self.table[row].zero_()
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: list[int]) -> None:
        if self.log is not None:        # a copy: callers pass lists they extend later
            self.log.append(TableWrite(row=row, start=start, slots=list(slots)))
        if self._host is not None:
            self._host[row, start:start + len(slots)] = slots
        else:
            self.table[row, start:start + len(slots)] = torch.tensor(slots, dtype=torch.int64)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. On CPU its memory comes from calloc (NumPy's zeros): the kernel
    maps zero pages on first touch, so a pool of gigabytes costs no time at startup and only
    the resident memory its used slots touch (torch.zeros writes every byte: ~6 s and the
    whole pool resident for the default model's 2.4 GB pool here)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)

