"""media/: where images may come from and what they may cost (sources.py), and the image
processors' pixels against transformers' own processors (processors.py)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from media.processors import Qwen2VLImages, expand, read_processor_config
from media.sources import MediaError, MediaPolicy, decode_image, load_image, read_bytes


def image(w: int, h: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    return Image.fromarray(rng.integers(0, 256, (h, w, channels), dtype=np.uint8), mode)


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header says width x height and whose pixel data is a few bytes: what a
    decompression bomb's first bytes look like."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + \
            struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) +
            chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


# ---- sources ------------------------------------------------------------------------------

def test_inline_base64_and_data_uri_decode_to_the_same_rgb_image():
    img = image(30, 20)
    data = png(img)
    for source in (b64(data), f"data:image/png;base64,{b64(data)}"):
        got = load_image(source, MediaPolicy())
        assert got.mode == "RGB" and got.size == (30, 20)
        assert np.array_equal(np.asarray(got), np.asarray(img))


def test_transparency_is_composited_onto_white():
    img = Image.new("RGBA", (4, 4), (10, 20, 30, 0))          # fully transparent
    got = load_image(b64(png(img)), MediaPolicy())
    assert np.asarray(got).tolist() == [[[255, 255, 255]] * 4] * 4


@pytest.mark.parametrize("source,message", [
    ("not base64 at all!", "neither valid base64"),
    ("data:text/plain;base64,aGVsbG8=", "data:image/<type>;base64"),
    ("", "non-empty string"),
])
def test_malformed_references_are_media_errors(source, message):
    with pytest.raises(MediaError, match=message):
        read_bytes(source, MediaPolicy())


def test_truncated_png_is_a_media_error():
    data = png(image(64, 64))
    with pytest.raises(MediaError, match="cannot be decoded"):
        decode_image(data[:len(data) // 2], MediaPolicy())


def test_a_huge_header_is_refused_before_decoding():
    with pytest.raises(MediaError, match="more than the limit of 40000000 pixels"):
        decode_image(png_header_only(20000, 20000), MediaPolicy())


def test_byte_limit_applies_to_inline_data():
    data = png(image(64, 64))
    with pytest.raises(MediaError, match="max-image-bytes"):
        read_bytes(b64(data), MediaPolicy(max_bytes=len(data) // 2))


def test_local_files_only_inside_the_allowed_directory(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(png(image(8, 8)))
    (tmp_path / "secret.png").write_bytes(png(image(8, 8, seed=1)))
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    policy = MediaPolicy(allowed_local_path=str(allowed))
    assert load_image(str(allowed / "cat.png"), policy).size == (8, 8)
    assert load_image(f"file://{allowed / 'cat.png'}", policy).size == (8, 8)
    for outside in (str(tmp_path / "secret.png"), str(allowed / "link.png"),
                    f"{allowed}/../secret.png", f"file://{tmp_path / 'secret.png'}"):
        with pytest.raises(MediaError, match="outside the directory"):
            read_bytes(outside, policy)
    with pytest.raises(MediaError, match="allowed-local-media-path"):
        read_bytes(str(allowed / "cat.png"), MediaPolicy())
    with pytest.raises(MediaError, match="does not exist"):
        read_bytes(str(allowed / "nope.png"), policy)


@pytest.fixture
def http_images():
    """A local HTTP server: /cat.png (an image), /big (more bytes than allowed below),
    /slow (a byte every 0.3 s), /redirect-file (a redirect to a file: URL)."""
    import http.server
    import threading
    import time as clock

    body = png(image(12, 10))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/redirect-file":
                self.send_response(302)
                self.send_header("Location", "file:///etc/passwd")
                self.end_headers()
                return
            self.send_response(200)
            self.end_headers()
            if self.path == "/cat.png":
                self.wfile.write(body)
            elif self.path == "/big":
                self.wfile.write(b"x" * 5000)
            elif self.path == "/slow":
                try:
                    for _ in range(40):
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        clock.sleep(0.3)
                except OSError:
                    pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_urls_are_fetched_within_limits_once_allowed(http_images):
    policy = MediaPolicy(allow_remote=True, timeout=1.0, max_bytes=4096)
    assert load_image(f"{http_images}/cat.png", policy).size == (12, 10)
    with pytest.raises(MediaError, match="max-image-bytes"):
        read_bytes(f"{http_images}/big", policy)
    # Each read gets a byte in time; the fetch as a whole does not (12 s of bytes).
    with pytest.raises(MediaError, match="media-fetch-timeout"):
        read_bytes(f"{http_images}/slow", policy)
    with pytest.raises(MediaError, match="not allowed|outside http"):
        read_bytes(f"{http_images}/redirect-file", policy)


def test_urls_only_with_the_flag():
    with pytest.raises(MediaError, match="allow-remote-media"):
        read_bytes("http://127.0.0.1:9/cat.png", MediaPolicy())
    with pytest.raises(MediaError, match="could not be fetched"):      # nothing listens on 9
        read_bytes("http://127.0.0.1:9/cat.png", MediaPolicy(allow_remote=True, timeout=2))


# ---- processors: the pixels transformers' own (PIL) processor makes -----------------------

@pytest.mark.parametrize("size", [(90, 60), (20, 20), (300, 40), (33, 97), (500, 500)])
@pytest.mark.parametrize("mode", ["RGB", "RGBA"])
def test_qwen2_vl_pixels_equal_transformers(size, mode, tmp_path):
    from transformers import Qwen2VLImageProcessorPil
    hf = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 16)
    hf.save_pretrained(str(tmp_path))
    ours = Qwen2VLImages(read_processor_config(tmp_path), image_token_id=7)
    img = image(*size, mode=mode)
    want = hf(images=[img], return_tensors="np")
    got = ours.process(load_image(b64(png(img)), MediaPolicy()))
    assert got.grid == want["image_grid_thw"][0].tolist()
    assert np.array_equal(got.pixels, want["pixel_values"])      # same ops, same dtypes
    t, h, w = got.grid
    assert got.tokens == [7] * (t * h * w // 4)


def test_expand_places_each_image_at_its_placeholder():
    class Processed:                    # what expand reads of a ProcessedImage
        def __init__(self, n):
            self.tokens = [9] * n
    ids, spans = expand([1, 9, 2, 3, 9, 4], [Processed(3), Processed(2)], 9)
    assert ids == [1, 9, 9, 9, 2, 3, 9, 9, 4]
    assert spans == [(1, 3), (6, 2)]
    with pytest.raises(MediaError, match="2 image placeholder.*1 image"):
        expand([1, 9, 9], [Processed(1)], 9)


@pytest.mark.parametrize("size", [(90, 60), (20, 20), (300, 40), (33, 97), (56, 56)])
@pytest.mark.parametrize("kind", ["clip", "llava_pad"])
def test_clip_pixels_equal_transformers(size, kind, tmp_path):
    from transformers import CLIPImageProcessorPil, LlavaImageProcessorPil
    from media.processors import ClipImages
    if kind == "clip":
        hf = CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56,
                                                                           "width": 56})
    else:                   # pad to a square in the mean colour first, then no crop needed
        hf = LlavaImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 48,
                                                                            "width": 56},
                                    do_pad=True)
    hf.save_pretrained(str(tmp_path))
    ours = ClipImages(read_processor_config(tmp_path), 5,
                      {"patch_size": 14, "vision_feature_select_strategy": "default",
                       "num_additional_image_tokens": 1})
    img = image(*size)
    want = hf(images=[img], return_tensors="np")["pixel_values"][0]
    got = ours.process(load_image(b64(png(img)), MediaPolicy()))
    assert np.array_equal(got.pixels, want)
    rows = (hf.crop_size.height // 14) * (hf.crop_size.width // 14)
    assert got.tokens == [5] * rows and got.grid == []


@pytest.mark.parametrize("size", [(100, 60), (60, 100), (7, 30), (300, 10), (32, 32), (128, 128)])
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("kind", ["smolvlm", "idefics3"])
def test_idefics3_tiles_equal_transformers(size, split, kind, tmp_path):
    """Pixels and tiles as transformers' PIL processors make them (SmolVLM's and
    Idefics3's are the same), and the expansion's text as Idefics3Processor writes it."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import \
        Idefics3ImageProcessorPil
    from transformers.models.smolvlm.image_processing_pil_smolvlm import \
        SmolVLMImageProcessorPil
    from media.processors import Idefics3Images
    kw = dict(size={"longest_edge": 128}, max_image_size={"longest_edge": 32},
              do_image_splitting=split)
    hf = (SmolVLMImageProcessorPil if kind == "smolvlm" else Idefics3ImageProcessorPil)(**kw)
    hf.save_pretrained(str(tmp_path))
    ours = Idefics3Images(read_processor_config(tmp_path), 1, {"image_seq_len": 2})
    ours.bind(lambda text: [1 if text[i:].startswith("<image>") else 0
                            for i in range(len(text)) if text[i] == "<"])   # markers only
    img = image(*size)
    want = hf(images=[img], return_tensors="np", return_row_col_info=True)
    got = ours.process(load_image(b64(png(img)), MediaPolicy()))
    rows, cols = want["rows"][0][0], want["cols"][0][0]
    assert got.grid == [rows, cols]
    assert np.array_equal(got.pixels, want["pixel_values"][0][:rows * cols + 1])
    assert got.tokens.count(1) == (rows * cols + 1) * 2


def test_a_vision_models_decoder_config():
    from wire.model_path import decoder_config
    text = {"architectures": ["VLlama3ForCausalLM"], "hidden_size": 8, "vocab_size": 10,
            "tie_word_embeddings": True}
    cfg = decoder_config({"architectures": ["Idefics3ForConditionalGeneration"],
                          "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                          "text_config": text})
    assert cfg["architectures"] == ["LlamaForCausalLM"]         # a decoder we serve
    assert cfg["tie_word_embeddings"] is False                  # the top level's
    assert cfg["torch_dtype"] == "bfloat16" and cfg["hidden_size"] == 8
    sparse = decoder_config({"architectures": ["Sarashina2VisionForCausalLM"],
                             "text_config": {"vocab_size": 102400}})
    assert sparse["hidden_size"] == 4096 and sparse["num_hidden_layers"] == 32   # LlamaConfig's
    plain = {"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True}
    assert decoder_config(plain) is plain
