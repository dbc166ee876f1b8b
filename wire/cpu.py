"""What this machine's CPU can run, read from /proc/cpuinfo without importing torch, and
which of zserve's kernels may run on it: the launcher resolves `--quantization auto` with
it before any model process starts, and models/kernels picks its kernels by it.

Two environment variables decide, for every process alike:

    ZSERVE_CPU_KERNELS=0   no zserve CPU kernel at all (torch's ops instead)
    ZSERVE_CPU_ISA=avx2    the AVX2 kernels even on a CPU with AVX-512 (to test or compare
                           them there); "avx512" or unset: AVX-512 where the CPU has it.

A kernel set runs where it is switched on, allowed and the CPU has its instructions
(runs_avx2_kernels, runs_avx512_kernels); kernels.available and kernels.function ask here.
"""

from __future__ import annotations

import functools
import os
import pathlib

from wire.model_path import StartupError

# What zserve's AVX2 kernels need (every x86-64 CPU since 2013): kernels/quant.c, and on
# CPUs without AVX-512 (or with ZSERVE_CPU_ISA=avx2) the *_avx2 functions of linear.c,
# attention.c and elementwise.c.
AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})
ISA_ENV = "ZSERVE_CPU_ISA"
ISAS = ("avx2", "avx512")              # its values, narrowest first


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


def widest_isa() -> str:
    """The widest instruction set zserve's kernels may use, from ZSERVE_CPU_ISA: "avx512"
    (unset or empty too: AVX-512 where the CPU has it, else AVX2) or "avx2" (AVX2 only);
    case does not matter. Any other value raises StartupError rather than being ignored:
    a misspelt "avx2" would otherwise test or measure the other kernels without a word.
    launch.py meets it at startup (runs_avx2_kernels, for --quantization) and reports it in
    one line; a process that picks kernels without it (a TP rank) fails on it at load."""
    value = os.environ.get(ISA_ENV, "").strip().lower() or "avx512"
    if value not in ISAS:
        raise StartupError(f"{ISA_ENV}={os.environ[ISA_ENV]!r}: expected one of "
                           f"{', '.join(ISAS)} (or unset: the widest the CPU has)")
    return value


def runs_avx2_kernels() -> bool:
    """Can this CPU run the AVX2 kernels, and are they switched on? Checks ZSERVE_CPU_ISA
    too (widest_isa), though either value allows them."""
    widest_isa()
    return kernels_switched_on() and AVX2_FLAGS <= cpu_flags()


def runs_avx512_kernels(needs: frozenset[str]) -> bool:
    """Can this CPU run AVX-512 kernels that need the flags `needs`, and may they run
    (switched on, and ZSERVE_CPU_ISA not "avx2")?"""
    return widest_isa() == "avx512" and kernels_switched_on() and needs <= cpu_flags()
