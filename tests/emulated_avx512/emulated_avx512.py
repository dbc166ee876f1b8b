"""pytest plugin for `make test-avx512-emulated` (run.sh): the kernel tests run on the library
run.sh built with every AVX-512 intrinsic emulated (SIMDe, plain C and AVX2), and wire.cpu
reports an AVX-512 CPU with VNNI and BF16, so every chooser picks the AVX-512 versions (and
the tests that fake other CPUs still can). Set up before collection: test modules read
kernels.available at import to mark their ISA parameters."""

from __future__ import annotations

import ctypes
import os

FLAGS = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                   "avx512_vnni"})


def pytest_configure(config):
    from models import kernels
    from wire import cpu

    lib = ctypes.CDLL(os.environ["ZSERVE_EMULATED_KERNELS"])
    for name, args in kernels.SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, kernels.RESTYPES.get(name)
    kernels.library = lambda: lib
    cpu.cpu_flags = lambda: FLAGS


def pytest_report_header(config):
    return ("kernels: zserve's AVX-512 versions, emulated (SIMDe) on this CPU; "
            f"CPU flags reported as {' '.join(sorted(FLAGS))}")
