"""Each vision family's image preprocessing, torch-free, as its checkpoint's
preprocessor_config.json says (to the letter: the resampling filter, rescale and normalize
in transformers' dtypes and order, so the pixels equal transformers' PIL-backend processor's),
and what one image becomes in the prompt.

    processor = image_processor(model_dir, architecture, image_token_id)  # None: text only
    processor.bind(encode)                         # the tokenizer, where an expansion has text
    out = processor.process(rgb_image)             # ProcessedImage
    out.pixels    # float32 array for the encoder (models/vision/)
    out.grid      # the family's geometry (Qwen2-VL: [t, h, w]); [] where there is none
    out.tokens    # the ids that replace the image's one placeholder in the prompt

A prompt names each image by one placeholder, the config's image token; `expand` replaces
the placeholders, in order, by the images' tokens. The encoder's output rows go to the
positions of the expansion that hold the image token (ImageFeatures in wire/messages.py).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from media.sources import MediaError

# The image processors' defaults (transformers' OPENAI_CLIP_MEAN / _STD), for configs
# that leave them out.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(slots=True)
class ProcessedImage:
    pixels: np.ndarray
    grid: list[int]
    tokens: list[int]

    def digest(self) -> str:
        """The image's identity: its pixels as the encoder sees them, and their geometry."""
        h = hashlib.sha256(np.ascontiguousarray(self.pixels).tobytes())
        h.update(repr((self.pixels.shape, str(self.pixels.dtype), self.grid)).encode())
        return h.hexdigest()[:32]


def read_processor_config(model_dir: str | Path) -> dict:
    """preprocessor_config.json, or (transformers 5's format) processor_config.json's
    "image_processor"; {} where there is neither."""
    root = Path(model_dir)
    if (root / "preprocessor_config.json").is_file():
        return json.loads((root / "preprocessor_config.json").read_text())
    if (root / "processor_config.json").is_file():
        return json.loads((root / "processor_config.json").read_text()).get(
            "image_processor", {})
    return {}


def read_processor_settings(model_dir: str | Path) -> dict:
    """processor_config.json's own settings (LlavaProcessor's patch_size, feature strategy,
    additional tokens), without the image processor's; {} where there is none."""
    path = Path(model_dir) / "processor_config.json"
    if not path.is_file():
        return {}
    return {k: v for k, v in json.loads(path.read_text()).items() if k != "image_processor"}


class Rescaled:
    """What every family shares: resample, rescale, normalize, as transformers' PIL
    backend does them (uint8 resize in Pillow; rescale in float64, then float32;
    (x - mean) / std in float32)."""

    def __init__(self, cfg: dict, mean=CLIP_MEAN, std=CLIP_STD):
        self.resample = Image.Resampling(cfg.get("resample", Image.Resampling.BICUBIC))
        self.do_resize = cfg.get("do_resize", True)
        self.do_rescale = cfg.get("do_rescale", True)
        self.rescale_factor = cfg.get("rescale_factor", 1 / 255)
        self.do_normalize = cfg.get("do_normalize", True)
        self.mean = np.array(cfg.get("image_mean", mean), dtype=np.float32)
        self.std = np.array(cfg.get("image_std", std), dtype=np.float32)

    def bind(self, encode) -> None:
        """The tokenizer's encode(text) -> ids, for families whose expansion has text."""

    def to_array(self, image: Image.Image | np.ndarray) -> np.ndarray:
        """An RGB image (resized already), or its [3, H, W] uint8 array -> [3, H, W] float32,
        rescaled and normalized."""
        x = image if isinstance(image, np.ndarray) else np.asarray(image).transpose(2, 0, 1)
        if self.do_rescale:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            x = x.astype(np.float32, copy=False)
            x = (x - self.mean[:, None, None]) / self.std[:, None, None]
        return x.astype(np.float32, copy=False)


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's: both sides multiples of `factor`, the area within [min, max] pixels,
    the aspect ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise MediaError(f"The image's aspect ratio ({width} x {height}) is more than 200:1.")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen2VLImages(Rescaled):
    """Qwen2-VL's image processor (Sarashina2-Vision uses it): resize to multiples of
    patch * merge within the pixel bounds, then patches of [C, T, P, P] flattened in the
    merge-block order the vision transformer expects; one image token per merge block."""

    def __init__(self, cfg: dict, image_token_id: int, processor: dict | None = None):
        super().__init__(cfg)
        size = cfg.get("size") or {}
        self.min_pixels = cfg.get("min_pixels") or size.get("shortest_edge") or 56 * 56
        self.max_pixels = cfg.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
        self.patch = cfg.get("patch_size", 14)
        self.temporal = cfg.get("temporal_patch_size", 2)
        self.merge = cfg.get("merge_size", 2)
        self.image_token_id = image_token_id

    def process(self, image: Image.Image) -> ProcessedImage:
        width, height = image.size
        if self.do_resize:
            h, w = smart_resize(height, width, self.patch * self.merge, self.min_pixels,
                                self.max_pixels)
            image = image.resize((w, h), resample=self.resample)
        x = self.to_array(image)
        c, h, w = x.shape
        p, m, t = self.patch, self.merge, self.temporal
        if h % (p * m) or w % (p * m):
            raise MediaError(f"The image is {w} x {h} pixels, not a multiple of {p * m}.")
        gh, gw = h // p, w // p
        patches = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        patches = np.broadcast_to(patches[:, :, :, :, :, None],
                                  (*patches.shape[:5], t, p, p))
        pixels = np.ascontiguousarray(patches.reshape(gh * gw, c * t * p * p))
        return ProcessedImage(pixels, [1, gh, gw],
                              [self.image_token_id] * (gh * gw // (m * m)))


class ClipImages(Rescaled):
    """CLIP's image processor (LLaVA's; LlavaImageProcessor adds do_pad): optionally pad to
    a square in the mean colour, resize the shortest edge, center-crop to the crop size
    (zero-padding what the image does not cover), one fixed-size crop per image. Its
    tokens: LlavaProcessor's count, (crop / patch_size)^2 + num_additional_image_tokens,
    less the class token under the "default" feature strategy (processor_config.json)."""

    def __init__(self, cfg: dict, image_token_id: int, processor: dict):
        super().__init__(cfg)
        size, crop = cfg.get("size") or {}, cfg.get("crop_size") or {}
        self.shortest = size.get("shortest_edge")
        self.square = (size.get("height"), size.get("width")) if "height" in size else None
        self.do_crop = cfg.get("do_center_crop", True)
        self.crop = (crop.get("height", 224), crop.get("width", 224))
        self.do_pad = cfg.get("do_pad", False)
        patch = processor.get("patch_size") or 14
        rows = (self.crop[0] // patch) * (self.crop[1] // patch) + \
            processor.get("num_additional_image_tokens", 1) - \
            (processor.get("vision_feature_select_strategy", "default") == "default")
        self.tokens = [image_token_id] * rows
        self.image_token_id = image_token_id

    def process(self, image: Image.Image) -> ProcessedImage:
        if self.do_pad and image.width != image.height:
            side = max(image.size)
            color = tuple(int(m * 255) for m in self.mean)
            square = Image.new("RGB", (side, side), color)
            square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
            image = square
        if self.do_resize:
            if self.square is not None:
                h, w = self.square
            else:           # the shortest edge to `shortest`, the other in proportion (floor)
                short, long = sorted((image.height, image.width))
                new_short, new_long = self.shortest, int(self.shortest * long / short)
                h, w = ((new_long, new_short) if image.width <= image.height
                        else (new_short, new_long))
            image = image.resize((w, h), resample=self.resample)
        x = np.asarray(image).transpose(2, 0, 1)
        if self.do_crop:
            x = center_crop(x, *self.crop)
        return ProcessedImage(self.to_array(x), [], list(self.tokens))


class Idefics3Images(Rescaled):
    """Idefics3's and SmolVLM's image processor (their PIL backends are the same): the
    longest edge resized to size["longest_edge"] (the other side even), then, with
    splitting, resized up to multiples of the tile size M and cut into M x M tiles
    row-major, with the whole image resized to M x M as the last tile ("global"); without,
    the one M x M image. LANCZOS by default, mean and std 0.5.

    Its tokens (Idefics3Processor's and SmolVLMProcessor's expansion): per tile row,
    `<fake_token_around_image><row_r_col_c>` + image_seq_len image tokens for each tile,
    then a newline; then a newline, `<fake_token_around_image><global-img>`, the global
    tile's image tokens, `<fake_token_around_image>`; an unsplit image is just the global
    block. The text is tokenized by `bind`'s encoder: every marker is a special token, so
    the pieces tokenize as they would inside the whole prompt."""

    def __init__(self, cfg: dict, image_token_id: int, processor: dict):
        super().__init__(cfg, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
        self.resample = Image.Resampling(cfg.get("resample", Image.Resampling.LANCZOS))
        self.longest = (cfg.get("size") or {}).get("longest_edge", 4 * 364)
        self.tile = (cfg.get("max_image_size") or {}).get("longest_edge", 364)
        self.split = cfg.get("do_image_splitting", True)
        self.seq_len = processor.get("image_seq_len", 169)
        self.image_token_id = image_token_id
        self.encode = None

    def bind(self, encode) -> None:
        """encode(text) -> ids without special tokens added: the tokenizer's. A tokenizer
        that does not spell the markers as single tokens is a startup error."""
        self.encode = encode
        self.expansion(1, 1)

    @staticmethod
    def _resize(x: np.ndarray, h: int, w: int, resample) -> np.ndarray:
        return np.asarray(Image.fromarray(x).resize((w, h), resample=resample))

    def process(self, image: Image.Image) -> ProcessedImage:
        x, m = np.asarray(image), self.tile
        h, w = x.shape[:2]
        if self.do_resize:                  # the longest edge to `longest`, the other even
            ar = w / h
            if w >= h:
                w = self.longest
                h = int(w / ar)
                h += h % 2
            else:
                h = self.longest
                w = int(h * ar)
                w += w % 2
            h, w = max(h, 1), max(w, 1)
            ar = w / h
            if w >= h and w > 4096:
                w, h = 4096, max(int(4096 / ar), 1)
            elif h > w and h > 4096:
                h, w = 4096, max(int(4096 * ar), 1)
            x = self._resize(x, h, w, self.resample)
        rows = cols = 0
        if not self.split:
            tiles = [self._resize(x, m, m, self.resample)]
        else:                               # up to multiples of the tile size
            ar = w / h
            if w >= h:
                w = math.ceil(w / m) * m
                h = math.ceil(int(w / ar) / m) * m
            else:
                h = math.ceil(h / m) * m
                w = math.ceil(int(h * ar) / m) * m
            x = self._resize(x, h, w, self.resample)
            if h > m or w > m:
                rows, cols = (h - m) // m + 1, (w - m) // m + 1
                tiles = [x[r * m:(r + 1) * m, c * m:(c + 1) * m]
                         for r in range(rows) for c in range(cols)]
                tiles.append(self._resize(x, m, m, self.resample))
            else:
                tiles = [x]
        pixels = np.stack([self.to_array(np.ascontiguousarray(t.transpose(2, 0, 1)))
                           for t in tiles])
        return ProcessedImage(pixels, [rows, cols], self.expansion(rows, cols))

    def expansion(self, rows: int, cols: int) -> list[int]:
        """The ids one image's placeholder becomes: the processors' text, tokenized whole
        (so a run like the last row's newline and the next one is one piece, as it is
        when transformers tokenizes the expanded prompt)."""
        image, fake = "<image>" * self.seq_len, "<fake_token_around_image>"
        text = ""
        for r in range(rows):
            text += "".join(f"{fake}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols))
            text += "\n"
        text += ("\n" if rows else "") + f"{fake}<global-img>{image}{fake}"
        ids = self.encode(text)
        tiles = rows * cols + 1
        if ids.count(self.image_token_id) != tiles * self.seq_len:
            raise MediaError("The tokenizer does not spell this model's image markers as "
                             "single tokens.")
        return ids


def center_crop(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' center_crop of a [C, H, W] array: the middle height x width, zero-padded
    (centred, the extra pixel after) where the image is smaller."""
    c, h, w = x.shape
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return x[:, top:top + height, left:left + width]
    out = np.zeros((c, max(h, height), max(w, width)), dtype=x.dtype)
    pt, pl = math.ceil((out.shape[1] - h) / 2), math.ceil((out.shape[2] - w) / 2)
    out[:, pt:pt + h, pl:pl + w] = x
    top, left = (out.shape[1] - height) // 2, (out.shape[2] - width) // 2
    return out[:, top:top + height, left:left + width]


# Architecture (wire.model_path.VISION_ARCHITECTURES) -> its image processor
PROCESSORS = {"Sarashina2VisionForCausalLM": Qwen2VLImages,
              "Qwen2VLForConditionalGeneration": Qwen2VLImages,
              "LlavaForConditionalGeneration": ClipImages,
              "Idefics3ForConditionalGeneration": Idefics3Images,
              "SmolVLMForConditionalGeneration": Idefics3Images}


def image_processor(model_dir: str | Path, architecture: str, image_token_id: int | None):
    """The model's image processor (ModelFacts' architecture and image token: config.json
    is the launcher's to read), or None for a model that takes no images."""
    if image_token_id is None:
        return None
    return PROCESSORS[architecture](read_processor_config(model_dir), image_token_id,
                                    read_processor_settings(model_dir))


def placeholders(ids: list[int], images: int, image_token_id: int) -> list[int]:
    """Where the prompt's image placeholders are; MediaError unless there are `images`."""
    where = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(where) != images:
        raise MediaError(f"The prompt has {len(where)} image placeholder(s) (token "
                         f"{image_token_id}) but the request has {images} image(s).")
    return where


def expand(ids: list[int], images: list[ProcessedImage], image_token_id: int
           ) -> tuple[list[int], list[tuple[int, int]]]:
    """Replace the prompt's placeholders (ids equal to image_token_id), in order, by each
    image's tokens. Returns the new ids and each image's (offset, length) in them.
    MediaError when the placeholders and the images differ in number."""
    where = placeholders(ids, len(images), image_token_id)
    out: list[int] = []
    spans = []
    start = 0
    for pos, image in zip(where, images):
        out += ids[start:pos]
        spans.append((len(out), len(image.tokens)))
        out += image.tokens
        start = pos + 1
    out += ids[start:]
    return out, spans
