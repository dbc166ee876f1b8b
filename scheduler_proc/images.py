"""The scheduler's side of images: which of a step's token rows take an image encoder's
output instead of their token's embedding, the encoder run once per new image, and the
embeddings kept by image hash (LRU, bounded in bytes) so an image seen again (the same
request after a retraction, another request with the same image) is not encoded again.

A request's images arrive preprocessed (wire ImageFeatures: pixels, geometry, the span of
the prompt they expand to; media/processors.py). `check` refuses what the encoder cannot
take; `step_embeds` maps a step's segments to (rows, values) for the model's forward, so
chunked prefill may cut through an image: each chunk takes the rows of its positions.
The radix cache keys an image's positions by its hash (Req.key_ids), so the KV of an image
is reused only for the same image.
"""

from __future__ import annotations

import bisect
import logging
from collections import OrderedDict
from math import prod

import numpy as np
import torch

from wire.messages import ImageFeatures

log = logging.getLogger(__name__)


def image_key(image: ImageFeatures) -> int:
    """What the radix cache holds at an image's positions in place of token ids: negative
    (never a token id), from 60 bits of its hash."""
    return -1 - int(image.hash[:15], 16)


class ImageEmbedder:
    def __init__(self, encoder, device: torch.device, dtype: torch.dtype,
                 capacity_bytes: int, mrope: bool = False):
        """mrope: the decoder takes multimodal RoPE positions (Qwen2-VL: `place`)."""
        self.encoder = encoder
        self.mrope = mrope
        self.device, self.dtype = device, dtype
        self.image_token_id = encoder.image_token_id
        self.capacity = capacity_bytes
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.cached_bytes = 0
        self.encoded = 0                    # images run through the encoder since start

    # ---- the boundary ---------------------------------------------------------------------

    def check(self, ids: list[int], images: list[ImageFeatures]) -> str | None:
        """Why these images cannot go with this prompt, or None: spans in order, inside the
        prompt, not overlapping; pixels whose size, dtype and geometry the encoder takes;
        as many image tokens in each span as the encoder makes rows."""
        end = 0
        for i, im in enumerate(images):
            if im.offset < end or im.length < 1 or im.offset + im.length > len(ids):
                return f"image {i}'s span ({im.offset}, {im.length}) is out of place."
            end = im.offset + im.length
            if im.dtype != "float32" or len(im.pixels) != 4 * prod(im.shape):
                return f"image {i}'s pixels are not float32 of shape {im.shape}."
            problem = self.encoder.check(list(im.shape), list(im.grid))
            if problem is not None:
                return f"image {i}: {problem}."
            tokens = ids[im.offset:end].count(self.image_token_id)
            if tokens != self.encoder.tokens(im.grid):
                return (f"image {i}'s span holds {tokens} image tokens; its grid makes "
                        f"{self.encoder.tokens(im.grid)}.")
        return None

    def place(self, req) -> None:
        """Multimodal RoPE: give req its positions (Req.rope_pos, rope_delta, image_rope):
        text advances one position a token; an image at position p takes p + its [t, h, w]
        offsets (encoder.positions) and moves the text on by the positions it spans."""
        pos, cur, i = [], 0, 0
        for image, where in zip(req.images or (), req.image_positions):
            pos += range(cur, cur + image.offset - i)
            cur += image.offset - i
            offsets, span = self.encoder.positions(list(image.grid))
            req.image_rope.append([[cur + o for o in axis] for axis in offsets])
            pos += [cur] * image.length         # overridden per row by image_rope
            cur += span
            i = image.offset + image.length
        n = len(req.input_ids)
        pos += range(cur, cur + n - i)
        req.rope_pos, req.rope_delta = pos, cur + n - i - n

    # ---- a step ---------------------------------------------------------------------------

    def rows(self, image: ImageFeatures) -> torch.Tensor:
        """The encoder's output for an image: cached, or computed now and cached."""
        got = self.cache.get(image.hash)
        if got is not None:
            self.cache.move_to_end(image.hash)
            return got
        pixels = torch.from_numpy(np.frombuffer(image.pixels, dtype=np.float32)  # a copy:
                                  .reshape(image.shape).copy())                # writable
        out = self.encoder(pixels.to(self.device, self.dtype), list(image.grid))
        self.encoded += 1
        log.debug("encoded image %s: %d rows (%d images so far)", image.hash[:12],
                  out.shape[0], self.encoded)
        size = out.numel() * out.element_size()
        if size <= self.capacity:
            self.cache[image.hash] = out
            self.cached_bytes += size
            while self.cached_bytes > self.capacity:
                _, old = self.cache.popitem(last=False)
                self.cached_bytes -= old.numel() * old.element_size()
        return out

    def step_embeds(self, segments) -> tuple | None:
        """(rows of the step's tokens, their inputs, and under multimodal RoPE their
        [3, rows] positions, else None) for the image positions the step's segments compute
        (segments in the order their tokens are laid out), or None."""
        rows, values, rope = [], [], []
        first_row = 0
        for seg in segments:
            req, start, end = seg.req, seg.start, seg.start + seg.length
            if not req.images or start >= len(req.input_ids):   # text, or a decode row
                first_row += seg.length
                continue
            for k, (image, where) in enumerate(zip(req.images, req.image_positions)):
                if image.offset >= end or image.offset + image.length <= start:
                    continue
                lo, hi = bisect.bisect_left(where, start), bisect.bisect_left(where, end)
                if lo < hi:
                    rows.append(torch.tensor(where[lo:hi]) - start + first_row)
                    values.append(self.rows(image)[lo:hi])
                    if self.mrope:
                        rope.append(torch.tensor([axis[lo:hi] for axis in req.image_rope[k]]))
            first_row += seg.length
        if not rows:
            return None
        return (torch.cat(rows).to(self.device), torch.cat(values),
                torch.cat(rope, dim=1).to(self.device) if rope else None)
