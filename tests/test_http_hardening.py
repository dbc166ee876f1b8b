"""End to end: what the HTTP boundary does with clients that are slow, huge, malformed,
unauthorized or never read, and how in-flight requests end at shutdown (issue 8)."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server import Server, serving, wait_idle, wait_until

pytestmark = pytest.mark.e2e

READ_TIMEOUT = 1.0
KEEP_ALIVE = 2.0        # uvicorn's own default is 5 s
LONG = {"max_new_tokens": 480, "ignore_eos": True}     # cannot finish before it is observed


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with serving(tiny_model("llama"), "--max-request-bytes", "4096", "--read-timeout",
                 str(READ_TIMEOUT), "--send-timeout", "1",
                 "--keep-alive-timeout", str(KEEP_ALIVE),
                 tmpdir=tmp_path_factory.mktemp("srv")) as s:
        yield s


def raw_connection(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(30)
    return sock


def read_response(sock: socket.socket) -> bytes:
    """One whole HTTP/1.1 response with a Content-Length body (its head and its body may
    come in separate segments, so one recv is not a response)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data + body!r}"
        body += chunk
    assert len(body) == length, (head, body)
    return head + b"\r\n\r\n" + body


def closed_by_server(sock: socket.socket) -> bool:
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, TimeoutError):
        return False


# ---- sizes and timeouts ---------------------------------------------------------------------

def test_body_over_the_limit_is_413_before_parsing(server):
    r = server.client.post("/generate", content=b"{" + b" " * 5000 + b"}",
                           headers={"content-type": "application/json"})
    assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]
    # A huge declared length is refused at once, without waiting for the body.
    sock = raw_connection(server)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n"
                 b"Content-Type: application/json\r\n\r\n{\"text\": \"a\"}")
    head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 413"), head[:100]
    sock.close()


def test_a_body_that_never_arrives_is_408(server):
    sock = raw_connection(server)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                 b"Content-Type: application/json\r\n\r\n{\"text\"")
    head = b""
    while b"did not arrive" not in head:       # headers and body may come apart
        chunk = sock.recv(65536)
        if not chunk:
            break
        head += chunk
    assert head.startswith(b"HTTP/1.1 408"), head[:100]
    assert b"did not arrive" in head
    sock.close()


def test_partial_headers_are_dropped_after_the_read_timeout(server):
    socks = [raw_connection(server) for _ in range(50)]
    for s in socks:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    silent = raw_connection(server)           # connects and sends nothing at all
    t0 = time.monotonic()
    assert all(closed_by_server(s) for s in [*socks, silent])
    assert time.monotonic() - t0 < READ_TIMEOUT + 10
    for s in [*socks, silent]:
        s.close()
    assert server.generate_ok(text="ok", sampling_params={"max_new_tokens": 2})


def test_keep_alive_connection_serves_after_a_slow_start(server):
    """The header deadline is per request: a client that sends its headers in time keeps
    its connection across requests."""
    with httpx.Client(base_url=server.url) as c:
        for _ in range(3):
            assert c.post("/generate", json={"text": "a", "sampling_params": {
                "max_new_tokens": 1}}).status_code == 200
            time.sleep(READ_TIMEOUT * 1.5)     # idle keep-alive is not a slow header


def test_idle_keep_alive_lasts_keep_alive_timeout(server):
    """An idle connection is served again until --keep-alive-timeout, then closed."""
    sock = raw_connection(server)
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    for idle in (0.0, KEEP_ALIVE / 2):
        time.sleep(idle)
        sock.sendall(request)
        assert read_response(sock).startswith(b"HTTP/1.1 200"), idle
    t0 = time.monotonic()
    assert closed_by_server(sock)
    assert KEEP_ALIVE * 0.9 < time.monotonic() - t0 < KEEP_ALIVE + 2.5
    sock.close()


@pytest.mark.parametrize("raw", [
    b'{"text": "a", "\\ud800": 1}',
    b'{"text": ' + b"[" * 3000 + b"]" * 3000 + b"}",
    b'{"text": "a", "sampling_params": {"max_new_tokens": ' + b"9" * 4400 + b"}}",
    b'{"text": "a", "sampling_params": {"temperature": NaN}}',
    b'{"text": "a", "sampling_params": {"top_p": Infinity}}',
], ids=["surrogate_key", "deep", "long_int", "nan", "infinity"])
def test_malformed_bodies_are_400_not_500(server, raw):
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        r = server.client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code in (400, 413), (path, r.status_code, r.text)
        assert r.json()["error"]["message"]


# ---- streams ----------------------------------------------------------------------------------

def never_read(server) -> int:
    """A 16-item stream of LONG requests from a client that reads nothing (a 4 KB receive
    buffer): once --send-timeout aborts it and drops the connection, the tokens generated
    for it."""
    before = wait_idle(server)["generated_tokens_total"]
    body = json.dumps({"input_ids": [[5, 6, 7]] * 16, "stream": True,
                       "sampling_params": LONG}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    wait_until(lambda: "read nothing for" in server.logs(), what="the stalled-stream warning")
    info = wait_idle(server)
    sock.settimeout(30)
    assert closed_by_server(sock)
    sock.close()
    return info["generated_tokens_total"] - before


def test_a_stream_that_is_never_read_is_aborted(server):
    """The client stops reading: the server must neither buffer without bound nor keep
    generating; after --send-timeout the requests are aborted and the connection dropped."""
    never_read(server)
    assert server.generate_ok(text="after", sampling_params={"max_new_tokens": 2})


@pytest.fixture(scope="module")
def incremental(tiny_model, tmp_path_factory):
    """One request runs at a time, so the 16 x 480 tokens take 16 requests' decoding end to
    end: on a fast machine the tiny model decoded all 16 at once within the second the
    send timeout waits (7,680 tokens generated, every request finished), and the count
    said nothing about the timeout."""
    with serving(tiny_model("llama"), "--send-timeout", "1", "--incremental-streaming-output",
                 "--max-running-requests", "1",
                 tmpdir=tmp_path_factory.mktemp("incr")) as s:
        yield s


def test_an_incremental_stream_that_is_never_read_is_aborted(incremental):
    """Incremental frames are small: without a bounded send buffer the kernel took all of
    them (issue 20: 64,000 tokens generated for a client that read nothing)."""
    generated = never_read(incremental)
    assert generated < 16 * LONG["max_new_tokens"], generated


def test_rid_reuse_never_ends_the_new_request(server):
    """A rid finished by a stop string is free at once; reusing it must not let the old
    request's release end the new one (internal ids are unique per submission)."""
    prompt = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 12,
                                                          "temperature": 0}}
    text = server.generate_ok(**prompt)["text"]
    stop = text[2:4] if len(text) >= 4 else text[-1:]
    for _ in range(60):
        first = server.generate_ok(**{**prompt, "rid": "reused", "sampling_params": {
            **prompt["sampling_params"], "stop": [stop]}})
        assert first["meta_info"]["finish_reason"]["type"] == "stop"
        second = server.generate_ok(**{**prompt, "rid": "reused"})
        assert second["meta_info"]["id"] == "reused"
        assert second["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    wait_idle(server)


def test_health_generate_runs_a_token(server):
    assert server.client.get("/health_generate").status_code == 200


# ---- limits and keys: one more server ----------------------------------------------------------

USER, ADMIN = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}


@pytest.fixture(scope="module")
def guarded(tiny_model, tmp_path_factory):
    """A queue limit and both keys (they do not interact: the queue test sends the user key)."""
    with serving(tiny_model("llama"), "--max-queued-requests", "4", "--max-running-requests",
                 "2", "--api-key", "k1", "--admin-api-key", "k2",
                 tmpdir=tmp_path_factory.mktemp("guarded")) as s:
        yield s


def test_max_queued_requests(guarded):
    s = guarded
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 64,
                                                        "ignore_eos": True}}
    with ThreadPoolExecutor(40) as pool:
        rs = list(pool.map(lambda _: s.client.post("/generate", json=body, headers=USER),
                           range(40)))
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(503) > 0 and codes.count(200) >= 4, codes
    for r in rs:
        if r.status_code == 503:
            assert "--max-queued-requests 4" in r.json()["error"]["message"]
        else:
            assert r.json()["meta_info"]["completion_tokens"] == 64
    r = s.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers=USER)
    assert r.status_code == 200
    s.client.headers.update(USER)           # wait_idle reads /server_info
    try:
        wait_idle(s)
    finally:
        del s.client.headers["Authorization"]


def test_a_queued_stream_gets_its_response_before_it_runs(guarded):
    """Issue 20: the status line used to wait for the first token, so a client with a
    header timeout gave up on a stream queued behind others. Now the response starts once
    the request is admitted: observed while both running slots are taken and it waits."""
    s = guarded
    blocker = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 480,
                                                           "ignore_eos": True}}
    with ThreadPoolExecutor(2) as pool, httpx.Client(base_url=s.url, timeout=120,
                                                     headers=USER) as c:
        blockers = [pool.submit(c.post, "/generate", json=blocker) for _ in range(2)]
        wait_until(lambda: c.get("/server_info").json()["running_requests"] == 2,
                   what="both slots taken")
        with c.stream("POST", "/generate", json={
                "input_ids": [8, 9], "stream": True,
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}) as r:
            assert r.status_code == 200
            info = c.get("/server_info").json()   # the slots are still taken: it waits
            lines = [ln for ln in r.iter_lines() if ln and not ln.startswith(":")]
        assert all(b.result().status_code == 200 for b in blockers)
    assert (info["running_requests"], info["queued_requests"]) == (2, 1), info
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["meta_info"]["completion_tokens"] == 4
    s.client.headers.update(USER)
    try:
        wait_idle(s)
    finally:
        del s.client.headers["Authorization"]


def test_auth_on_a_live_server(guarded):
    s = guarded
    assert s.client.get("/health").status_code == 200
    assert s.generate(text="a").status_code == 401
    r = s.client.post("/generate", json={"text": "a", "sampling_params": {
        "max_new_tokens": 2}}, headers=USER)
    assert r.status_code == 200
    assert s.client.post("/flush_cache", headers=USER).status_code == 403
    assert s.client.post("/flush_cache", headers=ADMIN).status_code == 200
    from openai import AuthenticationError, OpenAI
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=s.url + "/v1", api_key="wrong").models.list()
    assert OpenAI(base_url=s.url + "/v1", api_key="k1").models.list().data


STALL = {"ZSERVE_TEST_STALL_AFTER_STEPS": "1"}    # the scheduler hangs after its first step


def test_request_timeout_ends_a_request_that_cannot_finish(tiny_model, tmp_path):
    s = Server(tiny_model("llama"), "--request-timeout", "1", "--log-level", "info",
               tmpdir=tmp_path, env=STALL)
    try:
        t0 = time.monotonic()
        r = s.generate(text="a", sampling_params={"max_new_tokens": 8})
        assert r.status_code == 503, r.text
        assert "timed out after 1 s" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 30
        # Its first token was made before the stall: the log line counts it (and the prompt).
        line = next(x for x in s.logs().splitlines() if " generate: prompt" in x)
        assert re.search(r"prompt [1-9]\d*, completion 1, .*; abort 503$", line), line
        r = s.client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        assert s.server_info()["requests_in_flight"] == 0
    finally:
        s.kill()


def test_shutdown_deadline_ends_streams_with_an_error_event(tiny_model, tmp_path):
    s = Server(tiny_model("llama"), "--shutdown-timeout", "1", tmpdir=tmp_path, env=STALL)
    try:
        events: list[str] = []
        first = threading.Event()

        def read() -> None:
            with s.client.stream("POST", "/generate", json={
                    "text": "a", "stream": True, "sampling_params": LONG}) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        first.set()
        t = threading.Thread(target=read)
        t.start()
        assert first.wait(60)                   # the stream is running, the scheduler stuck
        unary = ThreadPoolExecutor(1).submit(s.generate, text="b")
        wait_until(lambda: s.server_info()["requests_in_flight"] == 2, what="two in flight")
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert not t.is_alive()
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))
        assert "shutting down" in error["error"]["message"]
        assert unary.result(60).status_code == 503
        assert s.proc.wait(60) == 0
        assert time.monotonic() - t0 < 30
    finally:
        s.kill()


def test_sglang_clients_default_fields_are_served(server):
    """SGLang's bench client and router send every GenerateReqInput field; defaults pass."""
    from tests.test_parse_generate import SGLANG_DEFAULT_BODY
    out = server.generate_ok(**SGLANG_DEFAULT_BODY)
    assert out["meta_info"]["completion_tokens"] == 2
    r = server.generate(text="a", lora_path="adapter")     # a server without adapters
    assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
