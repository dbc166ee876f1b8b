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
import subprocess

import pytest
import torch

from checkpoints.tiny import default_cache_root
from models import kernels
from models import loader
from test_gguf import write_gguf
from tests.server import Server

SIDECAR_LINE = "writing its config and tokenizer files into"
KERNELS_LINE = "compiling zserve's CPU kernels"


def test_a_kernel_build_says_so_before_it_compiles(tmp_path, caplog, monkeypatch):
    """The compile itself is not run here (it takes half a minute): the compiler is a
    stand-in that checks the line was logged before each call (one per source file), then
    fails like a broken cc."""
    said = []

    def compiler(*args, **kwargs):
        said.append(KERNELS_LINE in caplog.text)
        raise subprocess.CalledProcessError(1, args[0], stderr="stand-in")

    monkeypatch.setattr(kernels.subprocess, "run", compiler)
    with caplog.at_level(logging.INFO, logger=kernels.log.name):
        assert kernels.build_library(tmp_path / "kernels", "cc") is None
    assert said and all(said)


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
