"""The HTTP boundary: reading a request body and writing a JSON answer, whatever the client
sends.

Invariants kept here, for every route:
- A body is read only up to `--max-request-bytes` (413 before anything is parsed, from the
  Content-Length when there is one) and within `--read-timeout` seconds (408).
- A body that is not strict JSON (bad UTF-8, NaN/Infinity, nesting too deep, an integer too
  long for Python to convert) is a 400, never a 500.
- A JSON answer can always be written: text that UTF-8 cannot carry (a lone surrogate
  copied from a client's body into an error message) is sent \\u-escaped.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse as _StarletteJSONResponse


class BadRequest(ValueError):
    """Client error with the message to show. status: the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# Characters that some line readers take for line ends (Python's str.splitlines, hence
# httpx's iter_lines; JavaScript before ES2019) and that json.dumps leaves as they are (it
# escapes those below U+0020 already): escaped in JSON text, where they can only stand
# inside strings, so that an SSE frame stays one line to every client.
_LINE_BREAKERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028",
                                "\u2029": "\\u2029"})


def dumps(obj: Any) -> str:
    """JSON text that always encodes to UTF-8 (lone surrogates are escaped) and holds no
    character a line reader splits on but \\n (_LINE_BREAKERS)."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(obj, ensure_ascii=True, separators=(",", ":"))
    return text.translate(_LINE_BREAKERS)


class JSONResponse(_StarletteJSONResponse):
    """Starlette's JSONResponse, but never failing on text UTF-8 cannot carry."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


def error_response(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


@dataclass(frozen=True, slots=True)
class BodyLimits:
    max_bytes: int = 8 * 1024 * 1024
    timeout: float = 30.0


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_body(request: Request, limits: BodyLimits) -> bytes:
    length = request.headers.get("content-length")
    if length is not None:
        if not (length.isascii() and length.isdigit()):
            raise BadRequest("Invalid Content-Length header.")
        if int(length) > limits.max_bytes:
            raise BadRequest(f"The request body ({int(length)} bytes) is larger than the "
                             f"limit of {limits.max_bytes} bytes.", 413)

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_bytes:
                raise BadRequest(f"The request body is larger than the limit of "
                                 f"{limits.max_bytes} bytes.", 413)
            chunks.append(chunk)
        return b"".join(chunks)
    try:
        return await asyncio.wait_for(read(), limits.timeout)
    except asyncio.TimeoutError:
        raise BadRequest(f"The request body did not arrive within {limits.timeout:g} s.",
                         408) from None


async def read_json(request: Request, allow_empty: bool = False) -> Any:
    """The body as JSON, within the limits the app was built with (app.state.body_limits).
    allow_empty: an empty body is None instead of a 400."""
    raw = await read_body(request, getattr(request.app.state, "body_limits", BodyLimits()))
    if allow_empty and not raw.strip():
        return None
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest("Malformed JSON body: nested too deeply.") from None
    except (ValueError, UnicodeDecodeError) as e:   # JSONDecodeError is a ValueError, and so
        raise BadRequest(f"Malformed JSON body: {e}") from None   # is a too-long integer
