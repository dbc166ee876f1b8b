"""The guard around every route (api_proc/guard.py), in process: the app is built as the API
process builds it, and every route it has is called without a key, so a route added later
cannot slip past the check."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.routing import Route

from api_proc.app import build_app
from api_proc.guard import PUBLIC_PATHS
from api_proc.state import Dispatcher
from wire.addresses import Addresses
from wire.model_path import ModelFacts
from wire.server_args import ServerArgs, ServerConfig

KEY, ADMIN = "user-key", "admin-key"


def resolved(model_path: str, **flags) -> ServerConfig:
    """A resolved record for a model that is not there: the app reads no model file."""
    facts = ModelFacts("LlamaForCausalLM", 512, vocab_size=1000, num_params=0,
                       random_weights=True)
    return ServerConfig(ServerArgs(model_path=model_path, **flags), model_path=model_path,
                        tokenizer_path=model_path, served_model_name=model_path,
                        context_length=512, dtype="float32", model=facts,
                        model_source="model directory")


@pytest.fixture
def app():
    addrs = Addresses.create()
    args = resolved("/nonexistent", api_key=KEY, admin_api_key=ADMIN)
    dispatcher = Dispatcher(addrs)
    try:
        yield build_app(args, dispatcher, {})
    finally:
        dispatcher.close()
        addrs.cleanup()


class Client:
    """Requests straight into the ASGI app on this thread (httpx's ASGITransport under
    asyncio.run): no server, no portal thread."""

    def __init__(self, app):
        self.app = app

    def request(self, method: str, path: str, **kw) -> httpx.Response:
        async def go() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport,
                                         base_url="http://testserver") as c:
                return await c.request(method, path, **kw)
        return asyncio.run(go())

    def get(self, path: str, **kw) -> httpx.Response:
        return self.request("GET", path, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return self.request("POST", path, **kw)

    def options(self, path: str, **kw) -> httpx.Response:
        return self.request("OPTIONS", path, **kw)


@pytest.fixture
def client(app):
    return Client(app)


def routes(app) -> list[tuple[str, str]]:
    out = [(r.path, m) for r in app.routes if isinstance(r, Route)
           for m in sorted(r.methods or ()) if m != "HEAD"]
    assert ("/generate", "POST") in out and ("/v1/chat/completions", "POST") in out
    return out


def test_every_route_but_the_public_ones_needs_the_key(app, client):
    # Public: /health, and /dashboard (a static page: no data, the key is typed into it).
    assert PUBLIC_PATHS == {"/health", "/dashboard"}
    checked = 0
    for path, method in routes(app):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"x-api-key": "wrong"}):
            r = client.request(method, path, json={}, headers=headers)
            if path in PUBLIC_PATHS:
                assert r.status_code != 401, (path, method)
            else:
                assert r.status_code == 401, (path, method, headers, r.text)
                assert "API key" in r.json()["error"]["message"]
                assert r.headers["www-authenticate"] == "Bearer"
                checked += 1
    assert checked >= 30
    for path in ("/v1/messages", "/v1/responses", "/api/chat", "/api/tags"):
        assert any(p == path for p, _ in routes(app)), path


def test_the_key_may_come_as_x_api_key(client):
    """Anthropic's clients send the key in x-api-key: it opens what the Bearer form does."""
    r = client.post("/abort_request", json={"rid": "mine"}, headers={"x-api-key": KEY})
    assert r.status_code == 200
    r = client.post("/abort_request", json={"abort_all": True}, headers={"x-api-key": KEY})
    assert r.status_code == 403
    r = client.post("/abort_request", json={"abort_all": True}, headers={"x-api-key": ADMIN})
    assert r.status_code == 200


def test_admin_routes_need_the_admin_key(client):
    user = {"Authorization": f"Bearer {KEY}"}
    r = client.post("/flush_cache", json={}, headers=user)
    assert r.status_code == 403 and "admin" in r.json()["error"]["message"]
    r = client.post("/abort_request", json={"abort_all": True}, headers=user)
    assert r.status_code == 403 and "admin" in r.json()["error"]["message"]
    for path in ("/load_lora_adapter", "/unload_lora_adapter"):     # they read server paths
        r = client.post(path, json={"lora_name": "x", "lora_path": "/etc"}, headers=user)
        assert r.status_code == 403 and "admin" in r.json()["error"]["message"]
        r = client.post(path, json={"lora_name": "x", "lora_path": "/etc"}, headers={
            "Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
    # Aborting one's own request by its exact rid needs only the user key.
    r = client.post("/abort_request", json={"rid": "mine"}, headers=user)
    assert r.status_code == 200 and r.json() == {"aborted": 0}
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = client.post("/abort_request", json={"abort_all": True}, headers=admin)
    assert r.status_code == 200
    r = client.post("/abort_request", content=b"rid=x", headers={
        **admin, "content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415


def test_cross_origin_requests_are_refused(client):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = client.get("/v1/models", headers={**auth, "Origin": "http://evil.example"})
    assert r.status_code == 403 and "origin" in r.json()["error"]["message"]
    port = resolved("/m").args.port
    for own in (f"http://127.0.0.1:{port}", f"http://localhost:{port}",
                f"http://[::1]:{port}"):          # the dashboard's own page, on loopback
        r = client.get("/v1/models", headers={**auth, "Origin": own})
        assert r.status_code == 200, own
    # DNS rebinding: the page's name resolves to this server, so Host says the same as
    # Origin; the server compares with the address it was started on, not with Host.
    for host in ("evil.example", "testserver"):
        r = client.get("/v1/models", headers={**auth, "Origin": f"http://{host}:{port}",
                                              "Host": f"{host}:{port}"})
        assert r.status_code == 403, host


def test_own_origins_come_from_the_address_served():
    from api_proc.guard import own_origins
    assert own_origins("127.0.0.1", 8000) >= {"http://127.0.0.1:8000", "http://localhost:8000",
                                               "http://[::1]:8000", "https://localhost:8000"}
    assert own_origins("10.1.2.3", 80) == {"http://10.1.2.3:80", "http://10.1.2.3",
                                            "https://10.1.2.3:80"}
    wild = own_origins("0.0.0.0", 30000)
    assert "http://127.0.0.1:30000" in wild and "http://evil.example:30000" not in wild
    assert own_origins("::1", 5) >= {"http://[::1]:5", "http://localhost:5"}


def test_allowed_origins_get_cors_headers():
    addrs = Addresses.create()
    try:
        args = resolved("/m", allowed_origins="http://ui.example")
        dispatcher = Dispatcher(addrs)
        check_cors(Client(build_app(args, dispatcher, {})))
    finally:
        dispatcher.close()
        addrs.cleanup()


def check_cors(client) -> None:
    r = client.options("/generate", headers={
        "Origin": "http://ui.example", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://ui.example"
    r = client.get("/v1/models", headers={"Origin": "http://ui.example"})
    assert r.status_code == 200
    r = client.get("/v1/models", headers={"Origin": "http://other.example"})
    assert r.status_code == 403


def test_no_keys_means_an_open_local_server():
    addrs = Addresses.create()
    try:
        dispatcher = Dispatcher(addrs)
        client = Client(build_app(resolved("/m"), dispatcher, {}))
        assert client.get("/v1/models").status_code == 200
        assert client.post("/abort_request", json={"rid": "x"}).json() == {"aborted": 0}
    finally:
        dispatcher.close()
        addrs.cleanup()


def test_errors_are_json(client):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = client.get("/no/such/route", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"
    r = client.get("/generate", headers=auth)
    assert r.status_code == 405 and "error" in r.json()
