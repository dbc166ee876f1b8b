"""scheduler_proc/images.py in process, with a stand-in encoder: which rows of a step take
which image rows (chunks cutting through an image included), the embedding cache, the
checks of a decoded message's images, and the radix keys of an image's span."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from scheduler_proc.images import ImageEmbedder, image_key
from scheduler_proc.request import Req
from scheduler_proc.runner import Segment
from wire.messages import ImageFeatures, TokenizedRequest
from wire.sampling import SamplingParams

IMG = 9                 # the image token
HIDDEN = 4


class Encoder:
    """Rows of an image with grid [n]: n rows whose values say (image seed, row)."""

    image_token_id = IMG

    def __init__(self):
        self.calls = 0

    def tokens(self, grid):
        return grid[0]

    def check(self, shape, grid):
        return None if shape == [grid[0], 2] else f"pixels {shape} do not match {grid}"

    def __call__(self, pixels, grid):
        self.calls += 1
        seed = float(pixels[0, 0])
        return torch.stack([torch.full((HIDDEN,), seed * 100 + i) for i in range(grid[0])])


def features(seed: int, offset: int, n: int, extra: int = 0) -> ImageFeatures:
    """An image of n rows whose span (offset, n + extra) holds n image tokens first."""
    pixels = np.full((n, 2), seed, dtype=np.float32)
    return ImageFeatures(hash=hashlib.sha256(str(seed).encode()).hexdigest(), offset=offset, length=n + extra,
                         pixels=pixels.tobytes(), shape=[n, 2], grid=[n])


def request(ids, images) -> Req:
    msg = TokenizedRequest(rid="r", input_ids=ids, sampling=SamplingParams(), images=images)
    return Req(msg, "cpu", IMG)


def test_chunks_cutting_through_images_take_the_right_rows():
    ids = [1, 2, IMG, IMG, IMG, 3, IMG, IMG, 4]
    req = request(ids, [features(1, 2, 3), features(2, 6, 2)])
    enc = Encoder()
    emb = ImageEmbedder(enc, torch.device("cpu"), torch.float32, 1 << 20)
    other = request([5, 6], [])
    # A decode row of another request first, then chunks of 4, 3 and 2 positions.
    seen = {}
    for start, length in ((0, 4), (4, 3), (7, 2)):
        segs = [Segment(other, 1, 1, True), Segment(req, start, length, False)]
        got = emb.step_embeds(segs)
        if got is None:
            continue
        rows, values, rope = got
        assert rope is None                                 # no multimodal RoPE here
        for r, v in zip(rows.tolist(), values[:, 0].tolist()):
            assert r >= 1                                   # never the decode row
            seen[start + r - 1] = v
    assert seen == {2: 100.0, 3: 101.0, 4: 102.0, 6: 200.0, 7: 201.0}
    assert enc.calls == 2                                   # each image encoded once
    assert emb.step_embeds([Segment(other, 0, 2, True)]) is None


def test_only_image_tokens_of_a_span_take_rows():
    # A span with other tokens in it (tile markers): rows go to the image tokens, in order.
    ids = [1, 7, IMG, 8, IMG, 7, 2]
    img = ImageFeatures(hash="a" * 32, offset=1, length=5,
                        pixels=np.full((2, 2), 3, np.float32).tobytes(), shape=[2, 2],
                        grid=[2])
    req = request(ids, [img])
    rows, values, _ = ImageEmbedder(Encoder(), torch.device("cpu"), torch.float32,
                                    1 << 20).step_embeds([Segment(req, 0, 7, True)])
    assert rows.tolist() == [2, 4] and values[:, 0].tolist() == [300.0, 301.0]


def test_the_cache_is_lru_and_bounded():
    enc = Encoder()
    row_bytes = 3 * HIDDEN * 4
    emb = ImageEmbedder(enc, torch.device("cpu"), torch.float32, 2 * row_bytes)
    a, b, c = features(1, 0, 3), features(2, 0, 3), features(3, 0, 3)
    for im in (a, b, a, c):                 # c evicts b, the least recently used
        emb.rows(im)
    assert list(emb.cache) == [a.hash, c.hash] and emb.cached_bytes == 2 * row_bytes
    emb.rows(a)
    assert enc.calls == 3
    emb.rows(b)
    assert enc.calls == 4


def test_check_refuses_what_the_encoder_cannot_take():
    emb = ImageEmbedder(Encoder(), torch.device("cpu"), torch.float32, 1 << 20)
    ids = [1, IMG, IMG, IMG, 2]
    assert emb.check(ids, [features(1, 1, 3)]) is None
    assert "out of place" in emb.check(ids, [features(1, 3, 3)])
    assert "out of place" in emb.check(ids, [features(1, 1, 2), features(2, 2, 1)])
    # span [2, 5) holds IMG, IMG, 2: two image tokens for an image of three rows
    assert "holds 2 image tokens" in emb.check(ids, [features(1, 2, 3)])
    assert "do not match" in emb.check(ids, [ImageFeatures(
        "b" * 32, 1, 3, np.zeros((3, 3), np.float32).tobytes(), [3, 3], grid=[3])])
    short = features(1, 1, 3)
    short.pixels = short.pixels[:-4]
    assert "not float32" in emb.check(ids, [short])


def test_radix_keys_name_the_image_not_its_tokens():
    ids = [1, IMG, IMG, 2]
    a = request(ids, [features(1, 1, 2)])
    b = request(ids, [features(2, 1, 2)])
    assert a.token_ids(0, 4) == b.token_ids(0, 4) == ids
    assert a.key_ids(0, 4)[0] == 1 and a.key_ids(0, 4)[3] == 2
    assert a.key_ids(1, 3) == [image_key(features(1, 1, 2))] * 2
    assert a.key_ids(0, 4) != b.key_ids(0, 4)
    a.output_ids.append(5)
    assert a.key_ids(3, 5) == [2, 5]
    assert request(ids, []).key_ids(0, 4) == ids


class RopeEncoder(Encoder):
    """Images of n rows laid out 2 to a row (Qwen2-VL's [t, h, w] offsets)."""

    def positions(self, grid):
        n = grid[0]
        return [[0] * n, [i // 2 for i in range(n)], [i % 2 for i in range(n)]], (n + 1) // 2


def test_multimodal_rope_positions_of_text_and_images():
    ids = [1, 2, IMG, IMG, IMG, IMG, 3, 4]
    req = request(ids, [features(1, 2, 4)])
    emb = ImageEmbedder(RopeEncoder(), torch.device("cpu"), torch.float32, 1 << 20, mrope=True)
    emb.place(req)
    # text 0, 1; the image at 2 spans 2 positions (a 2 x 2 grid); text goes on from 4
    assert req.image_rope == [[[2, 2, 2, 2], [2, 2, 3, 3], [2, 3, 2, 3]]]
    assert req.positions(0, 2) == [0, 1] and req.positions(6, 8) == [4, 5]
    req.output_ids += [7, 8]
    assert req.positions(7, 10) == [5, 6, 7] and req.rope_delta == -2
    rows, _, rope = emb.step_embeds([Segment(req, 3, 3, False)])  # a chunk from the middle
    assert rows.tolist() == [0, 1, 2] and rope.tolist() == [[2, 2, 2], [2, 3, 3], [3, 2, 3]]
