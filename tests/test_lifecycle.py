"""End to end: the server's processes live and die together.

A child killed with SIGKILL ends the launcher with a non-zero exit and leaves no process;
SIGTERM exits 0 and removes the ipc directory; an idle server uses (almost) no CPU.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.server import Server

CHILDREN = ("tokenizer", "scheduler", "detokenizer")

pytestmark = pytest.mark.e2e


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def gone(procs: list[psutil.Process], timeout: float) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return not alive


def test_processes_have_titles_and_sigterm_exits_cleanly(tiny_model, tmp_path):
    s = Server(tiny_model("llama"), tmpdir=tmp_path)
    try:
        for name in CHILDREN:
            assert s.child(name).is_running()
        assert psutil.Process(s.proc.pid).cmdline()[0] == "zserve::api"
        assert list(tmp_path.glob("zserve-*/")), "the ipc directory lives under TMPDIR"
        ipc = next(tmp_path.glob("zserve-*/"))
        assert ipc.stat().st_mode & 0o777 == 0o700
        s.generate_ok(text="hello", sampling_params={"max_new_tokens": 4})
        procs = [psutil.Process(s.proc.pid), *s.children]
        assert s.terminate() == 0
        assert gone(procs, 10)
        assert not list(tmp_path.glob("zserve-*/")), "the ipc directory was not removed"
    finally:
        s.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_whole_process_group_exits_cleanly(tiny_model, tmp_path, sig):
    """Ctrl-C in a terminal or `timeout`/`kill -- -PGID` signal every process of the group:
    the children must not look crashed, the launcher exits 0."""
    s = Server(tiny_model("llama"), tmpdir=tmp_path)
    try:
        procs = [psutil.Process(s.proc.pid), *s.children]
        os.killpg(s.proc.pid, sig)
        assert s.proc.wait(timeout=30) == 0, s.logs()
        assert gone(procs, 10)
        assert "died" not in s.logs()
        assert not list(tmp_path.glob("zserve-*/"))
    finally:
        s.kill()


def test_default_demo_model(tmp_path):
    """No --model-path: the built-in demo model is built on first use and served."""
    cache = tmp_path / "cache"
    s = Server(None, tmpdir=tmp_path, env={"ZSERVE_CACHE": str(cache)})
    try:
        info = s.client.get("/model_info").json()
        assert info["is_generation"] is True
        assert info["model_path"].startswith(str(cache))
        out = s.generate_ok(text="Hello", sampling_params={"max_new_tokens": 5})
        assert out["meta_info"]["completion_tokens"] == 5
    finally:
        assert s.terminate() == 0


def test_idle_server_uses_no_cpu(tiny_model, tmp_path):
    s = Server(tiny_model("llama"), tmpdir=tmp_path)
    try:
        s.generate_ok(text="warm up", sampling_params={"max_new_tokens": 8})
        procs = [psutil.Process(s.proc.pid), *s.children]
        time.sleep(1.0)                       # let startup work settle
        before, t0 = cpu_seconds(procs), time.monotonic()
        time.sleep(3.0)
        used = (cpu_seconds(procs) - before) / (time.monotonic() - t0)
        assert used < 0.05, f"idle server used {used:.1%} of a core"
    finally:
        s.terminate()


@pytest.mark.parametrize("victim", CHILDREN)
def test_killed_child_takes_the_server_down(tiny_model, tmp_path, victim):
    s = Server(tiny_model("llama"), tmpdir=tmp_path)
    try:
        procs = [psutil.Process(s.proc.pid), *s.children]
        s.child(victim).send_signal(signal.SIGKILL)
        code = s.proc.wait(timeout=30)
        assert code != 0
        assert gone(procs, 10), [p for p in procs if p.is_running()]
        assert not list(tmp_path.glob("zserve-*/"))
        assert f"The {victim} process died" in s.logs()
    finally:
        s.kill()


def test_request_in_flight_fails_with_503_when_a_child_dies(tiny_model, tmp_path):
    import threading
    s = Server(tiny_model("llama"), tmpdir=tmp_path)
    try:
        result = {}

        def run():
            r = s.client.post("/generate", json={"text": "x", "sampling_params": {
                "max_new_tokens": 400, "ignore_eos": True}})
            result["status"] = r.status_code
            result["body"] = r.json()
        t = threading.Thread(target=run)
        t.start()
        time.sleep(0.3)
        s.child("detokenizer").send_signal(signal.SIGKILL)
        t.join(30)
        assert not t.is_alive()
        if result["status"] != 200:       # it may have finished before the kill
            assert result["status"] == 503, result
            assert "died" in result["body"]["error"]["message"]
        assert s.proc.wait(timeout=30) != 0
    finally:
        s.kill()


def test_context_longer_than_the_model_is_refused_at_startup(tiny_model):
    """RoPE is only defined up to max_position_embeddings: say so and exit non-zero,
    rather than serve positions the model has no table for."""
    import json
    import subprocess
    import sys

    from tests.server import REPO
    path = tiny_model("llama")
    limit = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    r = subprocess.run([sys.executable, str(REPO / "launch.py"), "--model-path", str(path),
                        "--context-length", str(limit + 1)],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert f"longer than the model's max_position_embeddings ({limit})" in r.stderr
