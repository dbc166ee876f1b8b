"""GET /dashboard: the live page (api_proc/static/dashboard.html, one self-contained file).

The page holds no data: what it shows comes from /server_info and /metrics, read by its
script with the API key typed into it, so the guard lets anyone load it (PUBLIC_PATHS) while
the routes it reads stay behind the key.

Its Content-Security-Policy allows the page's own inline <style> and <script> by hash (no
'unsafe-inline'), fetches to this server only, and nothing else: no other script, frame,
form target or image but a data: favicon.
"""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

PAGE = Path(__file__).with_name("static") / "dashboard.html"


def _hash_sources(html: str, tag: str) -> str:
    """CSP hash sources for the page's one inline block of `tag` (written bare, no
    attributes: that is what the hash covers)."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S)
    if len(blocks) != 1 or html.count(f"<{tag}") != 1:
        raise ValueError(f"{PAGE.name} must hold exactly one bare <{tag}> block")
    digest = hashlib.sha256(blocks[0].encode("utf-8")).digest()
    return f"'sha256-{base64.b64encode(digest).decode()}'"


def content_security_policy(html: str) -> str:
    return "; ".join([
        "default-src 'none'",
        f"script-src {_hash_sources(html, 'script')}",
        f"style-src {_hash_sources(html, 'style')}",
        "connect-src 'self'",
        "img-src data:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ])


def routes() -> list[Route]:
    """The page is read once, here (at build_app time)."""
    html = PAGE.read_text("utf-8")
    body = html.encode("utf-8")
    headers = {"Cache-Control": "no-store",
               "Content-Security-Policy": content_security_policy(html),
               "X-Content-Type-Options": "nosniff",
               "Referrer-Policy": "no-referrer"}

    async def dashboard(_: Request) -> Response:
        return Response(body, media_type="text/html; charset=utf-8", headers=headers)

    return [Route("/dashboard", dashboard, methods=["GET"])]
