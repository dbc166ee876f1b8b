"""Attention over the paged KV pool for one forward step of a ragged batch.

A step's tokens are laid out as [decode rows..., prefill segment 0..., segment 1..., ...].
A decode row is any segment of one token (a decoding request, or a prompt whose last token
is all that is left); all of them are attended in one batched call through the
request-to-token table, with a length mask instead of a Python loop. A prefill segment of L
tokens starting at position `start` attends to positions 0..start+L-1 causally.

The model calls `attn(layer, q, k, v)`; K/V of this step's tokens are written to their
slots first, then read back through the table, so a segment sees its cached prefix. A
prompt's chunk with no cached prefix attends its own K/V as computed; everything read from
the pool has the pool's precision (an int8 pool: rounded per block, pool.quantize_kv).

Each layer attends as its models.config.LayerAttention says (`layers`, from
config.attention_layers()): its softmax scale; a sliding window (a query at position p sees
positions > p - window: Mistral's and Gemma's local layers), applied by narrowing what is
read (a decode row's table slice, a chunk's prefix) and masking the rest, built once a step
per window size and only when some row reaches past it; Gemma 2's score soft-capping,
which SDPA cannot do: those layers attend in plain torch, as transformers' eager path does.
The pool keeps every position of every layer (a sliding layer's old positions are not
freed: docs/models.md says why).

Decode rows run on our C kernel (kernels/attention.c: reads K/V in place through the table,
float32, bfloat16 or int8 with its scales, online softmax in float32; AVX-512, else AVX2)
where `decode_kernel_fits`;
elsewhere (CUDA, other CPUs) they are gathered into a padded [B, T] batch for SDPA with a
length mask.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models import kernels
from models.config import LayerAttention
from models.ops import _decode_function, decode_kernel_fits
from scheduler_proc.pool import KVCache

_FULL = LayerAttention(scale=None)     # the default: head_dim ** -0.5, no window, no cap

@dataclass(slots=True)
class PrefillSegment:
    offset: int                      # first row of this segment in the step's flat batch
    start: int                       # first position computed
    length: int
    kv_index: torch.Tensor | None    # slots of positions 0..start+length-1 (None if start==0)
    mask: torch.Tensor | None        # [length, start+length] causal mask (None if start==0)


@dataclass(slots=True)
class DecodeRows:
    """The step's one-token rows: their table rows and lengths (kernel), or the padded
    slots and length mask (SDPA)."""

    rows: torch.Tensor                  # [B] row of each request in the table
    lens: torch.Tensor                  # [B] positions attended, the new token's included
    index: torch.Tensor | None = None   # [B, T] slots, padded with slot 0 (SDPA only)
    mask: torch.Tensor | None = None    # [B, 1, 1, T] True where attended (SDPA only)


@dataclass(slots=True)
class _Window:
    """The step's metadata narrowed to one window size: decode rows reading only their
    last `window` positions (kernel: their own [B, window] table, rows 0..B-1; SDPA: the
    mask), and per prefill segment (kv_index, mask, causal)."""

    decode: DecodeRows | None
    table: torch.Tensor | None                          # kernel decode rows' table
    prefills: list[tuple[torch.Tensor | None, torch.Tensor | None, bool]]


class StepAttention:
    """Metadata for one step, built once, used by every layer."""

    def __init__(self, cache: KVCache, table: torch.Tensor, out_slots: torch.Tensor,
                 decode: DecodeRows | None, prefills: list[PrefillSegment],
                 kernel: bool = False, layers: tuple[LayerAttention, ...] = (),
                 longest: int = 0):
        self.cache = cache
        self.kernel = kernel                # our C kernels (decode rows, K/V writes)
        self.table = table                  # the request-to-token table
        self.out_slots = out_slots          # [N] slot to write each token's K/V to
        self.decode = decode
        self.num_decode = 0 if decode is None else len(decode.rows)
        self.prefills = prefills
        self.layers = layers                # per layer; () for every layer _FULL
        # The window sizes some row of this step (`longest` positions) reaches past: their
        # layers read less than everything; the metadata for each is made on first use.
        self._windows: dict[int, _Window | None] = {
            w: None for w in {spec.window for spec in layers}
            if w is not None and w < longest}

    @property
    def windowed(self) -> bool:
        """Does some layer read less than everything this step (fast_decode.py: then not a
        step for decode.c)?"""
        return bool(self._windows)

    @classmethod
    def build(cls, cache: KVCache, table: torch.Tensor, out_slots: list[int],
              decode_rows: list[int], decode_lens: list[int],
              prefills: list[tuple[int, int, int]], device,
              decode_kernel: bool = False,
              layers: tuple[LayerAttention, ...] = ()) -> "StepAttention":
        """decode_rows/decode_lens: table row and sequence length (incl. the new token) of
        each decode row; prefills: (table row, start, length) per prefill segment;
        decode_kernel: decode_kernel_fits() for this model (decode rows run on it, unless
        a layer soft-caps its scores); layers: the model's config.attention_layers()."""
        out = torch.tensor(out_slots, dtype=torch.int64, device=device)
        decode_kernel = decode_kernel and not any(spec.softcap for spec in layers)
        longest = max([*decode_lens, *(start + length for _, start, length in prefills), 0])
        decode = None
        if decode_rows:
            decode = DecodeRows(torch.tensor(decode_rows, dtype=torch.int64, device=device),
                                torch.tensor(decode_lens, dtype=torch.int64, device=device))
            if not decode_kernel:
                t = max(decode_lens)
                decode.index = table[decode.rows, :t]
                decode.mask = (torch.arange(t, device=device)[None, :]
                               < decode.lens[:, None])[:, None, None, :]
        segs = []
        offset = len(decode_rows)
        for row, start, length in prefills:
            kv_index = m = None
            if start > 0:
                total = start + length
                kv_index = table[row, :total]
                q_pos = torch.arange(start, total, device=device)[:, None]
                m = torch.arange(total, device=device)[None, :] <= q_pos
            segs.append(PrefillSegment(offset, start, length, kv_index, m))
            offset += length
        return cls(cache, table, out, decode, segs, decode_kernel, tuple(layers), longest)

    def _window(self, window: int) -> _Window:
        """The metadata for layers of this window (module docstring), made once a step."""
        if (made := self._windows[window]) is not None:
            return made
        device = self.out_slots.device
        decode = table = None
        if self.decode is not None:
            d = self.decode
            lens = d.lens.clamp(max=window)
            first = d.lens - lens                            # the oldest position read
            if self.kernel:
                # Positions first..first+window-1 of each row: inside the table for a row
                # longer than the window; a shorter row reads only its lens of them.
                cols = (first[:, None] + torch.arange(window, device=device)
                        ).clamp(max=self.table.shape[1] - 1)
                table = self.table[d.rows[:, None], cols].contiguous()
                decode = DecodeRows(torch.arange(len(d.rows), device=device), lens)
            else:
                seen = (torch.arange(d.index.shape[1], device=device)[None, :]
                        >= first[:, None])
                decode = DecodeRows(d.rows, d.lens, d.index, d.mask & seen[:, None, None, :])
        prefills = []
        for s in self.prefills:
            total = s.start + s.length
            if total <= window:                              # the window changes nothing
                prefills.append((s.kv_index, s.mask, s.kv_index is None))
                continue
            lo = max(0, s.start - window + 1)                # the first position any query sees
            q_pos = torch.arange(s.start, total, device=device)[:, None]
            k_pos = torch.arange(lo, total, device=device)[None, :]
            mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
            prefills.append((None if s.kv_index is None else s.kv_index[lo:], mask, False))
        made = self._windows[window] = _Window(decode, table, prefills)
        return made

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        self._write(layer, k, v)
        spec = self.layers[layer] if self.layers else _FULL
        win = self._window(spec.window) if spec.window in self._windows else None
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        b = self.num_decode
        if b:
            self._decode(layer, q[:b], out[:b], spec, win)
        # Prefill: 4-D [1, H, L, D] inputs, the layout transformers uses (on CPU the 3-D
        # path rounds differently in bf16).
        for i, s in enumerate(self.prefills):
            rows = slice(s.offset, s.offset + s.length)
            qs = q[rows].transpose(0, 1).unsqueeze(0)
            kv_index, mask, causal = ((s.kv_index, s.mask, s.kv_index is None) if win is None
                                      else win.prefills[i])
            if kv_index is None:                             # fresh prompt: its own K/V only
                ks, vs = k[rows], v[rows]
            else:                                            # a cached prefix, then this chunk
                ks, vs = self.cache.gather(layer, kv_index)
            o = attend(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                       mask, causal, spec)
            out[rows] = o[0].transpose(0, 1)
        return out

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """This step's K/V into their slots; k, v: [N, Hkv, D] views (rows may be strided)."""
        cache = self.cache
        n, hkv, d = k.shape
        if (not self.kernel or k.stride(0) != v.stride(0) or k.stride(1) != d
                or v.stride(1) != d or k.stride(2) != 1 or v.stride(2) != 1):
            cache.write(layer, self.out_slots, k, v)
            return
        scales = None if cache.scales is None else cache.scales[layer].data_ptr()
        kernels.library().zs_kv_write(int(k.dtype == torch.bfloat16), cache.kind,
                                      cache.kv[layer].data_ptr(), scales,
                                      self.out_slots.data_ptr(), n, k.data_ptr(),
                                      v.data_ptr(), k.stride(0), hkv * d)

    def _decode(self, layer: int, q: torch.Tensor, out: torch.Tensor | None = None,
                spec: LayerAttention = _FULL, win: _Window | None = None) -> torch.Tensor:
        """One query per row against its own positions (its window's, with `win`):
        [B, H, D] -> [B, H, D], written into `out` (contiguous, e.g. the step output's
        first rows) when given."""
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        decode = self.decode if win is None else win.decode
        if self.kernel:
            self._decode_kernel(layer, q, out, spec, decode,
                                self.table if win is None else win.table)
            return out
        # SDPA. Half precision is attended in float32: the CPU kernel is faster there.
        dtype = q.dtype
        upcast = dtype != torch.float32 and q.device.type == "cpu"
        keys, values = self.cache.gather(layer, decode.index,          # [B, T, Hkv, D]
                                         torch.float32 if upcast else dtype)
        if upcast:
            q = q.float()
        o = attend(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                   decode.mask, False, spec)
        return out.copy_(o.squeeze(2))

    def _decode_kernel(self, layer: int, q: torch.Tensor, out: torch.Tensor,
                       spec: LayerAttention, decode: DecodeRows, table: torch.Tensor) -> None:
        """q: [B, H, D] with each row's heads contiguous (rows may be strided) -> out, a
        contiguous [B, H, D]."""
        b, h, d = q.shape
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        cache = self.cache
        kv = cache.kv[layer]
        scales = None if cache.scales is None else cache.scales[layer].data_ptr()
        _decode_function(q.device.type, q.dtype)(
            cache.kind, q.data_ptr(), q.stride(0), kv.data_ptr(), scales, table.data_ptr(),
            table.shape[1], decode.rows.data_ptr(), decode.lens.data_ptr(),
            b, h, kv.shape[2], d, d ** -0.5 if spec.scale is None else spec.scale,
            out.data_ptr())


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           causal: bool, spec: LayerAttention = _FULL) -> torch.Tensor:
    """softmax(q k^T * scale [capped]) v over [B, H, L, D] q and [B, Hkv, T, D] k, v (H a
    multiple of Hkv); mask: True where attended, broadcast to [B, H, L, T]; causal: the
    L queries are the last L of the T positions, attending causally (mask None). SDPA,
    or transformers' eager order for a soft-capped layer."""
    if spec.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=spec.scale, enable_gqa=True)
    h, hkv = q.shape[1], k.shape[1]
    if h != hkv:
        k, v = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    scale = q.shape[-1] ** -0.5 if spec.scale is None else spec.scale
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if causal:
        n, t = q.shape[2], k.shape[2]
        mask = (torch.arange(t, device=q.device)[None, :]
                <= torch.arange(t - n, t, device=q.device)[:, None])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
