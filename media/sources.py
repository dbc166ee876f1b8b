"""Where an image comes from, and what it may cost: a client's image reference (base64, a
`data:image/...;base64,` URI, a local path or `file://` URL, an http(s) URL) -> a decoded
RGB Pillow image, or MediaError with a message for the client (a 400).

What a client may make the server do is bounded here, before any pixel is decoded:
- inline data always; its decoded size at most `max_bytes`;
- local files only under `allowed_local_path` (after resolving symlinks and `..`), never
  outside it, and at most `max_bytes` read;
- http(s) URLs only when the operator opted in (`allow_remote`: a server that fetches any
  URL it is given is an SSRF hole), redirects only to http(s), at most `max_bytes` read;
  no read starts after `timeout` seconds and each waits at most that long, so a fetch
  (a server trickling bytes included) ends within twice `timeout` once connected;
- the pixel count from the image's header at most `max_pixels`, checked before the pixels
  are decoded (a 20,000 x 20,000 PNG of a few KB is a decompression bomb), and Pillow's own
  bomb check set to the same bound for formats whose size a header does not settle;
- a truncated or malformed file is a MediaError, never an exception that escapes.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

MAX_ERROR_SOURCE = 60       # characters of a client's reference quoted in an error


class MediaError(ValueError):
    """An image the server will not take; the message is for the client."""


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """The operator's limits (server flags: --allowed-local-media-path, --allow-remote-media,
    --max-image-bytes, --max-image-pixels, --media-fetch-timeout)."""

    allowed_local_path: str | None = None
    allow_remote: bool = False
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000
    timeout: float = 10.0

    @classmethod
    def of(cls, args) -> "MediaPolicy":
        """From ServerArgs."""
        return cls(args.allowed_local_media_path, args.allow_remote_media,
                   args.max_image_bytes, args.max_image_pixels, args.media_fetch_timeout)


def _quote(source: str) -> str:
    return repr(source if len(source) <= MAX_ERROR_SOURCE else source[:MAX_ERROR_SOURCE] + "...")


def load_image(source: str, policy: MediaPolicy) -> Image.Image:
    """The image `source` names, decoded, as RGB (transparency composited onto white, as
    transformers' processors do)."""
    return decode_image(read_bytes(source, policy), policy)


def read_bytes(source: str, policy: MediaPolicy) -> bytes:
    """The encoded bytes of the image `source` names (module docstring for what is allowed)."""
    if not isinstance(source, str) or not source:
        raise MediaError("An image must be a non-empty string: base64 data, a data: URI, "
                         "a file path or a URL.")
    scheme = source.split(":", 1)[0].lower() if ":" in source[:12] else ""
    if scheme == "data":
        return _data_uri(source, policy)
    if scheme in ("http", "https"):
        return _fetch(source, policy)
    if scheme == "file" or source.startswith("/"):
        return _local_file(source, policy)
    return _base64(source, policy)


def _base64(text: str, policy: MediaPolicy) -> bytes:
    if len(text) > (policy.max_bytes + 2) // 3 * 4 + 4:
        raise MediaError(f"The image is larger than the limit of {policy.max_bytes} bytes "
                         f"(--max-image-bytes).")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"The image {_quote(text)} is neither valid base64 data, nor a "
                         f"data: URI, nor an absolute file path or file:// or http(s) "
                         f"URL.") from None


def _data_uri(uri: str, policy: MediaPolicy) -> bytes:
    head, sep, data = uri.partition(",")
    if not sep or not head.lower().startswith("data:image/") or \
            not head.lower().endswith(";base64"):
        raise MediaError(f"A data URI must be data:image/<type>;base64,<data>; got "
                         f"{_quote(uri)}.")
    return _base64(data, policy)


def _local_file(source: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_path is None:
        raise MediaError("Local image files are not allowed on this server (it was started "
                         "without --allowed-local-media-path).")
    if source.startswith("file:"):
        parsed = urllib.parse.urlparse(source)
        if parsed.netloc not in ("", "localhost"):
            raise MediaError(f"A file URL must name a local file; got {_quote(source)}.")
        source = urllib.parse.unquote(parsed.path)
    if not source.startswith("/"):
        raise MediaError(f"A local image must be an absolute path; got {_quote(source)}.")
    root = Path(policy.allowed_local_path).resolve()
    try:
        path = Path(source).resolve(strict=True)
    except (OSError, RuntimeError):
        raise MediaError(f"The image file {_quote(source)} does not exist.") from None
    if not path.is_relative_to(root):
        raise MediaError(f"The image file {_quote(source)} is outside the directory this "
                         f"server may read images from (--allowed-local-media-path).")
    if not path.is_file():
        raise MediaError(f"The image file {_quote(source)} is not a regular file.")
    try:
        with open(path, "rb") as f:
            data = f.read(policy.max_bytes + 1)
    except OSError as e:
        raise MediaError(f"The image file {_quote(source)} cannot be read: "
                         f"{e.strerror}.") from None
    return _bounded(data, policy)


def _bounded(data: bytes, policy: MediaPolicy) -> bytes:
    if len(data) > policy.max_bytes:
        raise MediaError(f"The image is larger than the limit of {policy.max_bytes} bytes "
                         f"(--max-image-bytes).")
    return data


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is followed only to another http(s) URL (never file: or the like)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlparse(newurl).scheme not in ("http", "https"):
            raise MediaError("The image URL redirects outside http(s).")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_NoRedirects)


def _fetch(url: str, policy: MediaPolicy) -> bytes:
    if not policy.allow_remote:
        raise MediaError("Image URLs are not fetched by this server (it was started without "
                         "--allow-remote-media).")
    deadline = time.monotonic() + policy.timeout
    chunks, size = [], 0
    try:
        with _OPENER.open(urllib.request.Request(url, headers={"User-Agent": "zserve"}),
                          timeout=policy.timeout) as r:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MediaError(f"Fetching the image {_quote(url)} took longer than "
                                     f"{policy.timeout:g} s (--media-fetch-timeout).")
                chunk = r.read1(min(65536, policy.max_bytes + 1 - size))   # one recv
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size > policy.max_bytes:
                    break
    except MediaError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise MediaError(f"The image {_quote(url)} could not be fetched: {reason}.") from None
    return _bounded(b"".join(chunks), policy)


def decode_image(data: bytes, policy: MediaPolicy) -> Image.Image:
    """Encoded bytes -> an RGB image, within the pixel bound (checked on the header first)."""
    Image.MAX_IMAGE_PIXELS = policy.max_pixels     # Pillow's own check (at open), the same
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > policy.max_pixels:
                raise MediaError(f"The image is {width} x {height} pixels, more than the limit "
                                 f"of {policy.max_pixels} pixels (--max-image-pixels).")
            image.load()
            return to_rgb(image)
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise MediaError(f"The image decodes to more than the limit of {policy.max_pixels} "
                         f"pixels (--max-image-pixels).") from None
    except Exception as e:      # Pillow's many ways of saying "not an image I can read"
        raise MediaError(f"The image cannot be decoded: {type(e).__name__}: "
                         f"{str(e)[:200]}") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, compositing any transparency onto white (transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
