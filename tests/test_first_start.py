"""A first start says what it is doing, and every shutdown is quiet.

- The launcher logs before it builds a GGUF's sidecar (config + tokenizer files: seconds of
  transformers' tokenizer conversion, once per file), and the loader logs while the CPU
  kernels compile (once per version of their sources), instead of seconds of silence.
- A GGUF server's shutdown prints no "resource_tracker: There appear to be 1 leaked
  semaphore objects": the loader's progress bar used to make tqdm create a multiprocessing
  lock (a named semaphore) in the scheduler, which launch.py stops with SIGKILL.
"""

from __future__ import annotations

import logging
import shutil
import time

import pytest
import torch

from checkpoints.tiny import default_cache_root
from scheduler_proc import kernels
from scheduler_proc.models import loader
from test_gguf import write_gguf
from tests.server import Server

SIDECAR_LINE = "writing its config and tokenizer files into"
KERNELS_LINE = "compiling zserve's CPU kernels"


def test_the_loader_says_so_while_the_kernels_compile(tiny_model, caplog, monkeypatch):
    """A kernel build that takes a while (made to wait here until the line is logged)."""
    real = kernels.avx2_available
    calls = []

    def slow_first_build(device):
        if not calls:
            calls.append(device)
            deadline = time.monotonic() + 30
            while KERNELS_LINE not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.02)
        return real(device)

    monkeypatch.setattr(kernels, "avx2_available", slow_first_build)
    with caplog.at_level(logging.INFO, logger=loader.log.name):
        loader.load_model(tiny_model("llama"), torch.float32, "cpu")
    assert calls and KERNELS_LINE in caplog.text


def test_a_warm_load_says_nothing_of_kernels(tiny_model, caplog):
    kernels.library()                   # built (or found) before: the load itself is fast
    with caplog.at_level(logging.INFO, logger=loader.log.name):
        loader.load_model(tiny_model("llama"), torch.float32, "cpu")
    assert KERNELS_LINE not in caplog.text


@pytest.fixture
def fresh_cache(tmp_path):
    """An empty $ZSERVE_CACHE but for the kernels already built (no compile in this test)."""
    cache = tmp_path / "cache"
    built = default_cache_root() / "kernels"
    if built.is_dir():
        shutil.copytree(built, cache / "kernels")
    else:
        (cache / "kernels").mkdir(parents=True)
    return cache


@pytest.mark.e2e
def test_first_start_says_so_and_shutdown_is_quiet(tiny_model, tmp_path, fresh_cache):
    path = write_gguf(tiny_model("llama"), tmp_path / "tiny-llama.gguf")
    env = {"ZSERVE_CACHE": str(fresh_cache)}
    first = Server(path, "--log-level", "info", tmpdir=tmp_path, env=env)
    assert first.terminate() == 0, first.logs()
    logs = first.logs()
    assert SIDECAR_LINE in logs
    assert logs.index(SIDECAR_LINE) < logs.index("serving ")
    assert "leaked semaphore" not in logs, logs
    second = Server(path, "--log-level", "info", tmpdir=tmp_path, env=env)
    assert second.terminate() == 0, second.logs()
    assert SIDECAR_LINE not in second.logs()          # the sidecar is cached now
    assert "leaked semaphore" not in second.logs(), second.logs()
