"""How the CPU kernel library is built and chosen (scheduler_proc/kernels): compiled once
per source version into the cache, a failing compiler means torch's fallback rather than
an error, and ZSERVE_CPU_KERNELS=0 turns the kernels off."""

from __future__ import annotations

import logging

import pytest
import torch

from scheduler_proc import kernels
from scheduler_proc.models.cpu_linear import CpuLinear
from scheduler_proc.models.packed import PackedLinear


def test_built_once_then_reused(tmp_path, monkeypatch):
    lib = kernels.build_library(tmp_path, "cc")
    if lib is None:
        pytest.skip("no working C compiler here")
    built = list(tmp_path.glob("zserve-cpu-*.so"))
    assert len(built) == 1 and len(list(tmp_path.iterdir())) == 1    # no temporaries left
    mtime = built[0].stat().st_mtime_ns
    for name in kernels.SIGNATURES:
        assert getattr(lib, name).argtypes == kernels.SIGNATURES[name]
    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled again")
    monkeypatch.setattr(kernels.subprocess, "run", no_compiling)
    assert kernels.build_library(tmp_path, "cc") is not None
    assert built[0].stat().st_mtime_ns == mtime


@pytest.mark.parametrize("cc", ["false", "/nonexistent/cc"])
def test_a_failing_compiler_means_fallback(tmp_path, caplog, cc):
    with caplog.at_level(logging.WARNING):
        assert kernels.build_library(tmp_path, cc) is None
    assert "CPU kernels unavailable" in caplog.text
    assert list(tmp_path.glob("*.so")) == []             # no half-built file left behind


def test_env_turns_kernels_off(monkeypatch, tiny_model):
    from scheduler_proc.models import load_model
    path = tiny_model("llama")
    on = kernels.available("cpu", torch.float32)
    monkeypatch.setenv("ZSERVE_CPU_KERNELS", "0")
    assert not kernels.available("cpu", torch.float32)
    model = load_model(path, torch.float32, "cpu")
    assert isinstance(model.layers[0].mlp.down_proj, PackedLinear)
    monkeypatch.delenv("ZSERVE_CPU_KERNELS")
    if on:
        assert isinstance(load_model(path, torch.float32, "cpu").layers[0].mlp.down_proj,
                          CpuLinear)
