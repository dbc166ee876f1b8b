"""Who may call what: API keys, admin routes and browser origins, checked before any route.

Rules (README, "Hardening"):
- `--api-key KEY`: every route but /health and /dashboard (a static page holding no data:
  the key is typed into it, and its calls carry it) needs `Authorization: Bearer KEY`
  or `x-api-key: KEY` (Anthropic's clients' header) (401 otherwise).
  Deny by default: the check wraps the whole app, so a route added later is covered too.
  With only `--admin-api-key`, the routes that are not admin routes stay open.
- Admin routes (ADMIN_PATHS) act on other clients' work. With no key set anyone may call
  them (a local server); with any key set they need `--admin-api-key` (403 with the user
  key, 401 without a valid key), and are refused to everyone if no admin key was given.
  The admin key also opens every other route. Without admin rights /abort_request still
  aborts one request by its exact rid (a client's own request); prefixes and abort_all need
  the admin key. Handlers read the caller's rights from `request.state.admin`.
- Keys are compared in constant time (hmac.compare_digest).
- Browsers: a request whose Origin is neither the server's own nor in `--allowed-origins` is
  refused (403), so a web page cannot drive the server from a visitor's browser; with
  `--allowed-origins` Starlette's CORSMiddleware answers preflights for those origins.
  The server's own origins come from the address it was started on (`own_origins`: --host
  and --port; for a loopback host every loopback name, for 0.0.0.0 / :: every address of
  the machine's interfaces and its host name), never from the request's Host header: a
  DNS-rebinding page sends `Origin: http://evil.example:PORT` with `Host: evil.example:PORT`.
- Admin routes change state: POST only (the routes say so) and, when a body is sent, JSON
  only (415), so no HTML form can reach them.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket

from starlette.datastructures import Headers

from api_proc.boundary import JSONResponse

PUBLIC_PATHS = frozenset({"/health", "/dashboard"})
ADMIN_PATHS = frozenset({"/abort_request", "/flush_cache", "/load_lora_adapter",
                         "/unload_lora_adapter"})


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status,
                        headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)


def _same(given: str | None, key: str | None) -> bool:
    if given is None or key is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                               key.encode("utf-8", "surrogateescape"))


def parse_origins(value: str | None) -> list[str]:
    return [o.strip().rstrip("/") for o in (value or "").split(",") if o.strip()]


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def _url_host(host: str) -> str:
    """A host as it stands in a URL (IPv6 in brackets), lower case."""
    host = host.strip().lower()
    try:
        if ipaddress.ip_address(host.strip("[]")).version == 6:
            return f"[{host.strip('[]')}]"
    except ValueError:
        pass
    return host


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def own_origins(host: str, port: int) -> set[str]:
    """The origins of pages this server itself serves (its dashboard), from the address it
    was started on."""
    if host.strip() in WILDCARD_HOSTS:
        import psutil
        hosts = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values()
                 for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)}
        hosts |= {*LOOPBACK_NAMES, socket.gethostname()}
    elif _is_loopback(host):
        hosts = {host, *LOOPBACK_NAMES}
    else:
        hosts = {host}
    out = set()
    for h in map(_url_host, hosts):
        for scheme, default in (("http", 80), ("https", 443)):
            out.add(f"{scheme}://{h}:{port}")
            if port == default:
                out.add(f"{scheme}://{h}")        # browsers leave a default port out
    return out


class Guard:
    """ASGI middleware enforcing the rules above."""

    def __init__(self, app, api_key: str | None, admin_api_key: str | None,
                 allowed_origins: list[str], own: set[str] = frozenset()):
        self.app = app
        self.api_key = api_key
        self.admin_key = admin_api_key
        self.origins = {o.lower() for o in allowed_origins} | set(own)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal, admin = self._check(scope, Headers(scope=scope))
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        scope.setdefault("state", {})["admin"] = admin
        await self.app(scope, receive, send)

    def _check(self, scope, headers: Headers) -> tuple[JSONResponse | None, bool]:
        """(the refusal to send, or None) and whether the caller has admin rights."""
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin):
            return _error(f"Requests from origin {origin!r} are not allowed.", 403), False
        path = scope["path"]
        role = self._role(headers.get("authorization"), headers.get("x-api-key"))
        if path in PUBLIC_PATHS:
            return None, role == "admin"
        if role is None:
            return _error("Missing or invalid API key: send 'Authorization: Bearer KEY' "
                          "(or 'x-api-key: KEY').", 401), False
        if path in ADMIN_PATHS:
            kind = headers.get("content-type")
            if kind is not None and kind.split(";")[0].strip().lower() != "application/json":
                return _error(f"{path} takes a JSON body (Content-Type: application/json).",
                              415), False
            if role != "admin" and path != "/abort_request":
                return _error(f"{path} needs the admin API key.", 403), False
        return None, role == "admin"

    def _role(self, authorization: str | None, x_api_key: str | None) -> str | None:
        """'admin', 'user' or None (refused). The key comes as `Authorization: Bearer KEY`
        or, as Anthropic's clients send it, `x-api-key: KEY`."""
        if self.api_key is None and self.admin_key is None:
            return "admin"                       # no keys: a local server, open to all
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else None
        if token is None and x_api_key is not None:
            token = x_api_key.strip()
        if _same(token, self.admin_key):
            return "admin"
        if _same(token, self.api_key):
            return "user"
        return "user" if self.api_key is None else None   # only an admin key: open use

    def _origin_allowed(self, origin: str) -> bool:
        return "*" in self.origins or origin.rstrip("/").lower() in self.origins
