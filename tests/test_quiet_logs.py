"""End to end: what a user sees in the log of an ordinary day is quiet. Twenty streamed
clients that hang up (before their first token and mid-stream) and a SIGTERM leave no ERROR
line, no traceback and no leaked-semaphore warning, and the launcher exits 0."""

from __future__ import annotations

import signal
import threading

import httpx
import pytest

from tests.server import Server, wait_idle

pytestmark = pytest.mark.e2e


def hang_up(url: str, i: int) -> None:
    body = {"text": f"hello {i}", "stream": True,
            "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    # Every third client gives up before its stream starts, the others after one frame.
    timeout = 0.02 if i % 3 == 0 else 60.0
    try:
        with httpx.Client(base_url=url, timeout=timeout) as c, \
                c.stream("POST", "/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
    except httpx.TimeoutException:
        pass


def test_disconnects_and_sigterm_log_no_error(tiny_model, tmp_path):
    server = Server(tiny_model("llama"), "--log-level", "info", tmpdir=tmp_path)
    try:
        clients = [threading.Thread(target=hang_up, args=(server.url, i)) for i in range(20)]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        wait_idle(server)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
    finally:
        server.kill()
    log = server.logs()
    assert "aborted" in log.lower() or "499" in log or "abort" in log   # they did hang up
    bad = [ln for ln in log.splitlines()
           if " ERROR " in ln or "Traceback" in ln or "leaked" in ln]
    assert not bad, "\n".join(bad)
