"""Shared fixtures: tiny checkpoints (built once per session) and launched servers."""

from __future__ import annotations

import pytest

from checkpoints.tiny import ensure_checkpoint
from tests.server import Server, serving

FAMILIES = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory, worker_id):
    """Built once per run: under pytest-xdist the workers share the run's base directory
    (ensure_checkpoint builds under a temporary name and renames, so they may race)."""
    if worker_id == "master":
        return tmp_path_factory.mktemp("checkpoints")
    shared = tmp_path_factory.getbasetemp().parent / "checkpoints"
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture(scope="session")
def tiny_model(checkpoint_root):
    """tiny_model(family) -> path of that family's tiny checkpoint."""
    return lambda family: ensure_checkpoint(family, root=checkpoint_root)


@pytest.fixture(scope="session")
def llama_server(tiny_model, tmp_path_factory):
    """One tiny llama server with default flags, shared by every module that needs nothing
    else (a launch costs seconds of CPU on a 2-core machine). Each test leaves it as it
    found it: idle, its pool whole (tests/server.py wait_idle); a test that needs an empty
    prefix cache flushes it first."""
    with serving(tiny_model("llama"), tmpdir=tmp_path_factory.mktemp("shared")) as s:
        yield s


@pytest.fixture
def launch(tmp_path):
    """launch(model_path, *flags) -> a running Server, stopped after the test."""
    servers: list[Server] = []

    def start(model_path, *flags) -> Server:
        servers.append(Server(model_path, *flags, tmpdir=tmp_path))
        return servers[-1]
    yield start
    for s in servers:
        s.terminate()


@pytest.hookimpl(trylast=True)          # after -m has deselected: GPUs counted only if asked
def pytest_collection_modifyitems(items):
    """End-to-end files first (stable otherwise): under pytest-xdist the files are handed to
    the workers in this order, and ending on short unit files keeps both workers busy to the
    end instead of one waiting on the other's last server. Tests marked `cuda` (`gpus=N`:
    that many, default 1) are skipped, saying why, where this machine has fewer GPUs."""
    items.sort(key=lambda item: item.get_closest_marker("e2e") is None)
    gpus = None
    for item in items:
        if (marker := item.get_closest_marker("cuda")) is None:
            continue
        if gpus is None:
            gpus, why = cuda_devices()
        needs = marker.kwargs.get("gpus", 1)
        if gpus < needs:
            item.add_marker(pytest.mark.skip(reason=f"needs {needs} CUDA GPU"
                                             f"{'s' * (needs > 1)}: {why}"))


def cuda_devices() -> tuple[int, str]:
    """(how many CUDA GPUs torch sees here, in words)."""
    import torch
    if torch.version.cuda is None:
        return 0, f"torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return 0, "no CUDA GPU visible (driver, CUDA_VISIBLE_DEVICES)"
    n = torch.cuda.device_count()
    return n, f"{n} visible"
