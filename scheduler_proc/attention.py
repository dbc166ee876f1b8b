"""Attention over the paged KV pool for one forward step of a ragged batch.

A step's tokens are laid out as [decode rows..., prefill segment 0..., segment 1..., ...].
A decode row is any segment of one token (a decoding request, or a prompt whose last token
is all that is left); all of them are attended in one batched call through the
request-to-token table, with a length mask instead of a Python loop. A prefill segment of L
tokens starting at position `start` attends to positions 0..start+L-1 causally.

The model calls `attn(layer, q, k, v)`; K/V of this step's tokens are written to their
slots first, then read back through the table, so a segment sees its cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from scheduler_proc.pool import KVCache


@dataclass(slots=True)
class PrefillSegment:
    offset: int                      # first row of this segment in the step's flat batch
    start: int                       # first position computed
    length: int
    kv_index: torch.Tensor | None    # slots of positions 0..start+length-1 (None if start==0)
    mask: torch.Tensor | None        # [length, start+length] causal mask (None if start==0)


class StepAttention:
    """Metadata for one step, built once, used by every layer."""

    def __init__(self, cache: KVCache, out_slots: torch.Tensor, num_decode: int,
                 decode_index: torch.Tensor | None, decode_mask: torch.Tensor | None,
                 prefills: list[PrefillSegment]):
        self.cache = cache
        self.out_slots = out_slots          # [N] slot to write each token's K/V to
        self.num_decode = num_decode
        self.decode_index = decode_index    # [B, T] slots, padded with slot 0
        self.decode_mask = decode_mask      # [B, 1, 1, T] True where a position is attended
        self.prefills = prefills

    @classmethod
    def build(cls, cache: KVCache, table: torch.Tensor, out_slots: list[int],
              decode_rows: list[int], decode_lens: list[int],
              prefills: list[tuple[int, int, int]], device) -> "StepAttention":
        """decode_rows/decode_lens: table row and sequence length (incl. the new token) of
        each decode row; prefills: (table row, start, length) per prefill segment."""
        out = torch.tensor(out_slots, dtype=torch.int64, device=device)
        index = mask = None
        if decode_rows:
            lens = torch.tensor(decode_lens, dtype=torch.int64, device=device)
            t = max(decode_lens)
            index = table[torch.tensor(decode_rows, device=device), :t]
            mask = (torch.arange(t, device=device)[None, :] < lens[:, None])[:, None, None, :]
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
        return cls(cache, out, len(decode_rows), index, mask, segs)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer, self.out_slots, k, v)
        out = torch.empty_like(q)
        b = self.num_decode
        if b:
            out[:b] = self._decode(layer, q[:b])
        # Prefill: 4-D [1, H, L, D] inputs, the layout transformers uses (on CPU the 3-D
        # path rounds differently in bf16).
        for s in self.prefills:
            rows = slice(s.offset, s.offset + s.length)
            qs = q[rows].transpose(0, 1).unsqueeze(0)
            if s.kv_index is None:                           # fresh prompt: its own K/V only
                ks, vs = k[rows], v[rows]
                mask, causal = None, True
            else:                                            # a cached prefix, then this chunk
                ks, vs = self.cache.gather(layer, s.kv_index)
                mask, causal = s.mask, False
            o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1).unsqueeze(0),
                                               vs.transpose(0, 1).unsqueeze(0),
                                               attn_mask=mask, is_causal=causal,
                                               enable_gqa=True)
            out[rows] = o[0].transpose(0, 1)
        return out

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """One query per row against its own positions: [B, H, D] -> [B, H, D]. Half
        precision is attended in float32: the CPU kernel is faster there (and exact)."""
        dtype = q.dtype
        upcast = dtype != torch.float32 and q.device.type == "cpu"
        keys, values = self.cache.gather(layer, self.decode_index,     # [B, T, Hkv, D]
                                         torch.float32 if upcast else None)
        if upcast:
            q = q.float()
        o = F.scaled_dot_product_attention(q.unsqueeze(2), keys.transpose(1, 2),
                                           values.transpose(1, 2),
                                           attn_mask=self.decode_mask, enable_gqa=True)
        return o.squeeze(2).to(dtype)
