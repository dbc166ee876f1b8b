"""What this machine's CPU can run, read from /proc/cpuinfo without importing torch: the
launcher resolves `--quantization auto` with it before any model process starts, and
scheduler_proc/kernels checks its kernels' instructions with it."""

from __future__ import annotations

import functools
import os
import pathlib

# What zserve's AVX2 kernels need (every x86-64 CPU since 2013): kernels/quant.c, and on
# CPUs without AVX-512 the *_avx2 functions of linear.c, attention.c and elementwise.c.
AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's feature flags (empty where /proc/cpuinfo is missing, e.g. macOS)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def kernels_switched_on() -> bool:
    """False where ZSERVE_CPU_KERNELS=0 rules every zserve CPU kernel out (to compare with
    torch's ops, or to rule the kernels out)."""
    return os.environ.get("ZSERVE_CPU_KERNELS", "1") != "0"


def runs_avx2_kernels() -> bool:
    """Can this CPU run the AVX2 kernels, and are they switched on?"""
    return kernels_switched_on() and AVX2_FLAGS <= cpu_flags()
