"""How the CPU kernel library is built and chosen (models/kernels): compiled once
per source version into the cache, a failing compiler means torch's fallback rather than
an error, ZSERVE_CPU_KERNELS=0 turns the kernels off, and which version serves (AVX-512,
AVX2 or torch) follows the CPU's flags and ZSERVE_CPU_ISA (wire/cpu.py), tested by faking
the flags."""

from __future__ import annotations

import logging

import pytest
import torch

from models import kernels
from models import ops
from models.cpu_linear import CpuLinear
from models.packed import PackedLinear
from wire import cpu
from wire.model_path import StartupError


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
    from models import load_model
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


# ---------------------------------------------------------------------------------------
# Which version serves: one rule (wire/cpu.py), tested here on any CPU by faking its flags

AVX2 = set(cpu.AVX2_FLAGS)
AVX512 = {"avx512f", "avx512bw", "avx512vl"}
AVX512_BF16 = AVX512 | {"avx512_bf16"}
AVX512_VNNI = AVX512 | {"avx512_vnni"}


@pytest.fixture
def fake_cpu(monkeypatch):
    """fake_cpu(flags, isa=None): wire.cpu reports these CPU flags and ZSERVE_CPU_ISA=isa
    (None: unset). The caches that hold a choice made before are emptied, before and after."""
    if kernels.library() is None:
        pytest.skip("no working C compiler here")
    caches = (ops._kernels_for, ops._decode_function)

    def fake(flags, isa=None):
        monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))
        monkeypatch.delenv("ZSERVE_CPU_KERNELS", raising=False)
        if isa is None:
            monkeypatch.delenv(cpu.ISA_ENV, raising=False)
        else:
            monkeypatch.setenv(cpu.ISA_ENV, isa)
        for c in caches:
            c.cache_clear()
    yield fake
    for c in caches:
        c.cache_clear()


def served(name, dtype):
    """The C function's name that function() picks for `name`, or None (torch)."""
    fn = kernels.function(name, "cpu", dtype)
    return None if fn is None else fn.func.__name__


@pytest.mark.parametrize("flags, isa, f32, bf16", [
    (AVX2 | AVX512_BF16, None, "avx512", "avx512"),
    (AVX2 | AVX512_BF16, "avx512", "avx512", "avx512"),
    (AVX2 | AVX512_BF16, "AVX512", "avx512", "avx512"),
    (AVX2 | AVX512_BF16, "", "avx512", "avx512"),          # set but empty: as unset
    (AVX2 | AVX512_BF16, "avx2", "avx2", "avx2"),
    (AVX2 | AVX512_BF16, " AVX2 ", "avx2", "avx2"),
    (AVX2 | AVX512, None, "avx512", "avx2"),                # no AVX512_BF16
    (AVX2 | AVX512, "avx2", "avx2", "avx2"),
    (AVX2, None, "avx2", "avx2"),
    (AVX2, "avx512", "avx2", "avx2"),      # the widest allowed, not a demand
    (AVX512_BF16, None, "avx512", "avx512"),                # (no such CPU; no AVX2 kernels)
    (AVX512_BF16, "avx2", None, None),
    (set(), None, None, None),
])
def test_isa_rule(fake_cpu, flags, isa, f32, bf16):
    """Each dtype's kernels: AVX-512 where the CPU has the flags and ZSERVE_CPU_ISA allows
    them, else AVX2 where the CPU has those, else torch; every chooser agrees."""
    fake_cpu(flags, isa)
    for dtype, want in ((torch.float32, f32), (torch.bfloat16, bf16)):
        assert kernels.available("cpu", dtype) == (want == "avx512")
        assert kernels.linear_available("cpu", dtype) == (want is not None)
        for name in ("zs_decode_attention", "zs_add_rms_norm", "zs_rope", "zs_silu_mul"):
            assert served(name, dtype) == {"avx512": name, "avx2": name + "_avx2",
                                           None: None}[want]
        if want is not None:
            linear = CpuLinear(torch.randn(16, 32, dtype=dtype), None)
            assert linear.avx512 == (want == "avx512")
        assert not kernels.available("cuda", dtype)
    assert kernels.avx2_available("cpu") == (AVX2 <= set(flags))


@pytest.mark.parametrize("flags, isa, vnni", [
    (AVX2 | AVX512_VNNI, None, True),
    (AVX2 | AVX512_VNNI | {"avx512_bf16"}, "avx512", True),
    (AVX2 | AVX512_VNNI, "avx2", False),
    (AVX2 | AVX512, None, False),          # AVX-512 without VNNI: quant.c's AVX2 tiles
    (AVX2 | {"avx512_vnni"}, None, False),  # (no such CPU) VNNI without AVX-512 F/BW/VL
    (AVX512_VNNI, None, False),             # no AVX2: quant.c does not run at all
    (AVX2, None, False),
])
def test_vnni_rule(fake_cpu, flags, isa, vnni):
    """quant.c's AVX-512 VNNI tiles where the CPU has AVX-512 F/BW/VL and VNNI and
    ZSERVE_CPU_ISA allows AVX-512 (and the AVX2 kernels run: they round x); every
    QuantLinear then carries that choice into blocks.c."""
    from models.quant_linear import QuantLinear
    fake_cpu(flags, isa)
    assert kernels.vnni_available("cpu") == vnni
    assert not kernels.vnni_available("cuda")
    if kernels.avx2_available("cpu"):
        lin = QuantLinear("Q8_0", torch.zeros(8, 34, dtype=torch.uint8), 32)
        lin.c_blocks()
        assert lin._c.vnni == vnni


def test_avx2_isa_on_an_avx512_cpu_runs_the_avx2_kernels(fake_cpu, tmp_path):
    """With ZSERVE_CPU_ISA=avx2 on a (faked) AVX-512 CPU a whole model loads onto the AVX2
    kernels: every linear layer, the elementwise ops, decode attention and the fast decode
    path. They run here (no AVX-512 instruction is reached), as they do on this CPU."""
    from checkpoints.tiny import build_tiny_checkpoint
    from models import load_model
    from test_fast_decode import both_paths
    from test_gguf import IDS, our_logits
    if not kernels.avx2_available("cpu"):
        pytest.skip("this CPU has no AVX2: nothing would run")
    path = build_tiny_checkpoint(tmp_path, "llama", hidden_size=128, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=192)  # heads of 32
    model = load_model(path, torch.float32, "cpu")
    avx2_here = not kernels.available("cpu", torch.float32)
    here = our_logits(model, IDS), both_paths(model, 3)[0][0]
    fake_cpu(AVX2 | AVX512_BF16, "avx2")
    model = load_model(path, torch.float32, "cpu")
    linears = [m for m in model.modules() if isinstance(m, CpuLinear)]
    assert linears and not any(m.avx512 for m in linears)
    assert ops._kernel(IDS.float()).rope.func.__name__ == "zs_rope_avx2"
    assert ops._decode_function("cpu", torch.float32).func.__name__ == (
        "zs_decode_attention_avx2")
    assert model.fast is not None and model.fast.c.avx512 == 0
    logits, ((fast, fast_kv), (slow, slow_kv)) = our_logits(model, IDS), both_paths(model, 3)
    assert torch.equal(fast, slow)
    assert all(torch.equal(a, b) for a, b in zip(fast_kv, slow_kv))
    if avx2_here:                          # the same kernels ran unfaked: the same numbers
        assert torch.equal(logits, here[0]) and torch.equal(fast, here[1])


@pytest.mark.parametrize("value", ["avx-2", "avx512f", "sse4", "0"])
def test_an_unknown_isa_is_refused_at_startup(fake_cpu, tiny_model, value):
    """A misspelt ZSERVE_CPU_ISA would silently test the other kernels: it is a one-line
    StartupError where the launcher resolves its flags, and wherever kernels are chosen."""
    from launch import resolve_args
    from wire.server_args import ServerArgs
    fake_cpu(AVX2 | AVX512_BF16, value)
    with pytest.raises(StartupError, match=f"ZSERVE_CPU_ISA='{value}': expected one of "
                                           "avx2, avx512"):
        resolve_args(ServerArgs(model_path=tiny_model("llama")))
    with pytest.raises(StartupError, match="ZSERVE_CPU_ISA"):
        kernels.available("cpu", torch.float32)
