"""A real zserve server for end-to-end tests: launch.py as a subprocess on a free port.

Nothing is mocked: tests talk HTTP to it and signal its processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT = 180.0


def die_with_parent():
    """A preexec_fn that has the kernel SIGTERM the child when the thread that started it
    dies, even by SIGKILL (Linux's PR_SET_PDEATHSIG), or None elsewhere. prctl is looked up
    here, in the parent: the child only calls it. (Start children from the main thread:
    the signal follows the starting thread, not the process.)"""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGTERM)     # 1: PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_path: str | Path | None, *extra: str,
                 tmpdir: str | Path | None = None, env: dict | None = None,
                 one_thread: bool = True):
        """model_path None: the built-in demo model. one_thread: OMP_NUM_THREADS=1 unless
        the environment sets it (tests: the suite runs two test files at once on two
        cores, and spinning OpenMP workers of two servers would only steal each other's
        time); False for benchmarks, where the server picks its own thread counts."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        model_args = [] if model_path is None else ["--model-path", str(model_path)]
        env = {**({"OMP_NUM_THREADS": "1"} if one_thread else {}), **os.environ, **(env or {})}
        if tmpdir is not None:                  # where the server's ipc directory goes
            env["TMPDIR"] = str(tmpdir)
        self.log_path = Path(tmpdir or "/tmp") / f"zserve-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "launch.py"), *model_args,
             "--port", str(self.port), "--log-level", "warning", *extra],
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True,     # its own process group, as under a shell's job control
            preexec_fn=die_with_parent())   # a killed test run or bench leaves no server
        self.client = httpx.Client(base_url=self.url, timeout=120.0)
        try:
            self._wait_healthy()
        except BaseException:           # a failed or interrupted (Ctrl-C) startup leaves
            with contextlib.suppress(ProcessLookupError):           # no process behind
                os.killpg(self.proc.pid, signal.SIGKILL)            # (its own group)
            self.kill()
            raise
        self.children = psutil.Process(self.proc.pid).children(recursive=True)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT}s:\n{self.logs()}")

    def logs(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def child(self, title: str) -> psutil.Process:
        """A child process by its title, e.g. 'scheduler'."""
        for p in self.children:
            if p.cmdline() and p.cmdline()[0] == f"zserve::{title}":
                return p
        raise LookupError(f"no zserve::{title} among {[p.cmdline() for p in self.children]}")

    # ---- HTTP -------------------------------------------------------------------------------

    def generate(self, **body) -> httpx.Response:
        return self.client.post("/generate", json=body)

    def generate_ok(self, **body):
        r = self.generate(**body)
        assert r.status_code == 200, r.text
        return r.json()

    def stream(self, **body) -> list[dict]:
        """POST a streaming /generate; returns the JSON frames (asserting the [DONE] end)."""
        frames = []
        with self.client.stream("POST", "/generate", json={**body, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = "".join(r.iter_text())
        events = [e for e in raw.split("\n\n") if e and not e.startswith(":")]  # comments
        assert events[-1] == "data: [DONE]", events[-1]
        for e in events[:-1]:
            assert e.startswith("data: "), e
            frames.append(json.loads(e[len("data: "):]))
        return frames

    def server_info(self) -> dict:
        return self.client.get("/server_info").json()

    # ---- lifecycle ----------------------------------------------------------------------

    def terminate(self, timeout: float = 30.0) -> int:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        """Last resort: no process may outlive a test."""
        if self.proc.poll() is None:
            self.proc.kill()
        for p in getattr(self, "children", []):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()
        self.log.close()


# ---- waiting for a state (the timeouts only guard against a hang; they assume no speed) ----

def wait_until(condition, timeout: float = 60.0, what: str = "condition"):
    """Poll condition() until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def pool_whole(info: dict) -> bool:
    """The KV pool's idle invariant: every slot is free or holds an evictable prefix."""
    kv = info["kv_pool"]
    return kv["free"] + kv["evictable"] == kv["total"] > 0


def wait_idle(server: "Server", timeout: float = 60.0) -> dict:
    """/server_info once nothing runs, waits or is in flight and the pool is whole again."""
    def idle():
        info = server.server_info()
        return info if (info["running_requests"] == info["queued_requests"] ==
                        info["requests_in_flight"] == 0 and pool_whole(info)) else None
    return wait_until(idle, timeout, "the server to go idle with its KV pool whole")


def wait_running(server: "Server", n: int = 1) -> dict:
    """Until /server_info shows n requests running. A unary request shows as running from
    its first token on: the scheduler sends a request's first token at once."""
    return wait_until(lambda: (i := server.server_info())["running_requests"] >= n and i,
                      what=f"{n} running requests")


@contextlib.contextmanager
def serving(model_path, *flags: str, tmpdir, env: dict | None = None):
    """A Server for the length of a `with` block (a module fixture's body); when the block
    ends it must stop cleanly: SIGTERM, exit 0."""
    s = Server(model_path, *flags, tmpdir=tmpdir, env=env)
    try:
        yield s
    finally:
        code = s.terminate()
    assert code == 0, s.logs()


@contextlib.contextmanager
def serving_until_killed(model_path, *flags: str, tmpdir, env: dict | None = None):
    """serving() for a module whose last test kills the server (a launch saved): when the
    block ends the server has exited already, or must stop cleanly."""
    s = Server(model_path, *flags, tmpdir=tmpdir, env=env)
    try:
        yield s
    finally:
        killed = s.proc.poll() is not None
        code = s.terminate()
    assert killed or code == 0, s.logs()
