"""End to end: the server's processes live and die together.

A child killed with SIGKILL fails the requests in flight with 503 and ends the launcher
with a non-zero exit within 10 s, leaving no process;
SIGTERM exits 0 and removes the ipc directory; an idle server uses (almost) no CPU; a
harness (test run, benchmark) killed with SIGKILL leaves no server behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from tests.server import REPO, Server, wait_idle

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


def test_idle_server_uses_no_cpu(llama_server):
    assert_idle_uses_no_cpu(llama_server)


def assert_idle_uses_no_cpu(s: Server) -> None:
    """After a request, the whole process tree (every child of every kind) uses under 5%
    of a core while idle."""
    s.generate_ok(text="warm up", sampling_params={"max_new_tokens": 8})
    wait_idle(s)
    procs = [psutil.Process(s.proc.pid), *s.children]
    # A busy-waiting loop uses a core in every window; a window that catches leftover work
    # (a startup thread winding down, a neighbour stealing time) is measured again.
    used = []
    for _ in range(3):
        before, t0 = cpu_seconds(procs), time.monotonic()
        time.sleep(2.0)
        used.append((cpu_seconds(procs) - before) / (time.monotonic() - t0))
        if used[-1] < 0.05:
            break
    assert min(used) < 0.05, f"idle server used {min(used):.1%} of a core at best"


# A request that cannot finish before the test kills a child: it runs to the end of the
# 512-token context (prompt + max_new_tokens must stay below it).
LONG_PROMPT = [11, 12, 13, 14]
LONG = {"input_ids": LONG_PROMPT, "sampling_params": {
    "max_new_tokens": 512 - len(LONG_PROMPT) - 1, "ignore_eos": True}}


@pytest.mark.parametrize("victim", CHILDREN)
def test_killed_child_takes_the_server_down(tiny_model, tmp_path, victim):
    """Acceptance: a request running when a child is SIGKILLed fails with a 503 naming the
    death, and the server exits non-zero within 10 s of the kill, leaving no process (of
    those it started, or any other in its process group) and no ipc directory."""
    s = Server(tiny_model("llama"), tmpdir=tmp_path)
    try:
        assert list(tmp_path.glob("zserve-*/"))
        assert_death_takes_the_server_down(s, victim, tmp_path)
    finally:
        s.kill()


def assert_death_takes_the_server_down(s: Server, victim: str, tmp_path) -> None:
    """SIGKILL the child titled `victim` while a request runs: the request gets a 503 naming
    the death, and the server exits non-zero within 10 s of the kill, leaving no process
    and no ipc directory (under tmp_path)."""
    procs = [psutil.Process(s.proc.pid), *s.children]
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(s.client.post, "/generate", json=LONG)
        wait_running(s, future)
        s.child(victim).send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        r = future.result(timeout=30)
    assert r.status_code == 503, r.text
    assert "died" in r.json()["error"]["message"]
    code = s.proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
    assert code != 0, s.logs()
    assert gone(procs, max(deadline - time.monotonic(), 0.0)), \
        [p for p in procs if p.is_running()]
    assert not left_in_group(s.proc.pid)
    assert not list(tmp_path.glob("zserve-*/"))
    assert f"The {victim} process died" in s.logs()


def wait_running(s: Server, future) -> None:
    """Until /server_info shows the request running (its first token is out; the scheduler
    sends a request's first token at once). The timeout only guards against a hang."""
    deadline = time.monotonic() + 30
    while s.server_info()["running_requests"] < 1:
        assert time.monotonic() < deadline and not future.done(), "the request never ran"
        time.sleep(0.05)


def left_in_group(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of a process group: the server runs in its own."""
    left = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return left


def test_a_killed_harness_leaves_no_server(tiny_model, tmp_path):
    """A test run or benchmark killed with SIGKILL leaves no server behind: the kernel sends
    the launcher SIGTERM (tests/server.die_with_parent), which takes its children down."""
    code = (f"import json, time; from tests.server import Server; "
            f"s = Server({str(tiny_model('llama'))!r}, tmpdir={str(tmp_path)!r}); "
            f"print(json.dumps([s.proc.pid] + [c.pid for c in s.children]), flush=True); "
            f"time.sleep(600)")
    harness = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE)
    try:
        procs = [psutil.Process(pid) for pid in json.loads(harness.stdout.readline())]
        assert len(procs) >= 1 + len(CHILDREN)
    finally:
        harness.kill()
        harness.wait()
    assert gone(procs, 30), [p.name() for p in procs if p.is_running()]


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
