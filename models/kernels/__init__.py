"""zserve's own CPU kernels (in C): the library and its ctypes signatures.

    linear.c       y = x W^T + b on weights laid out in panels (models/cpu_linear.py)
    blocks.c       y = x W^T + b on GGUF's blocks (every type QuantLinear serves), float x:
                   each block dequantized in registers (models/quant_linear.py)
    quant.c        the same on every type but Q2_K and Q3_K with x rounded
                   to int8 (large batches): AVX2, or AVX-512 VNNI where `vnni_available`
    attention.c    decode attention read in place from the paged KV pool (attention.py)
    elementwise.c  residual add + RMSNorm, RoPE, SiLU-and-multiply (models/llama.py)
    decode.c       every layer of a step of decode rows in one call (models/fast_decode.py)
    simd.h         what they share: float32/bfloat16 loads and stores, exp

The C files are compiled on first use with the system C compiler (`cc`; one file per core
at a time, about 30 s on 2 cores, blocks.c the longest) into $ZSERVE_CACHE/kernels/, named by the hash of their sources and flags, and loaded
with ctypes (which releases the GIL for each call). They run their threads on the libgomp
that torch has already loaded, so torch.set_num_threads holds for them too.
`available(device, dtype)` is false where the CPU lacks the instructions a dtype's kernels
need (float32: AVX-512 F, BW and VL; bfloat16: also AVX512_BF16), where ZSERVE_CPU_ISA=avx2
asks for the AVX2 ones instead (to test or compare them on an AVX-512 CPU), where the
compiler is missing or fails, or where ZSERVE_CPU_KERNELS=0 is set (to compare, or to rule
them out); callers then fall back to torch (oneDNN-packed linears, SDPA, plain elementwise
ops). Both switches are read in wire/cpu.py (runs_avx512_kernels), the rule's one home.
AVX2 versions (AVX2 + FMA + F16C: every x86-64 CPU since 2013) have their own check,
`avx2_available(device)`: the quantized linear layers (where it is false, quantized
weights are dequantized at load instead: --quantization, README "Quantized weights";
blocks.c's AVX-512 version serves them where `available(cpu, float32)`), and
where `available` is false the *_avx2 functions of linear.c, attention.c and elementwise.c
(float32 and bfloat16). `function(name, device, dtype)` picks attention.c's and
elementwise.c's version by that rule; CpuLinear and FastDecode ask `available`.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import subprocess
import tempfile

import torch

from checkpoints.tiny import default_cache_root
from wire.cpu import runs_avx2_kernels, runs_avx512_kernels

log = logging.getLogger(__name__)

HERE = pathlib.Path(__file__).parent
SOURCES = sorted(HERE.glob("*.c"))
HEADERS = sorted(HERE.glob("*.h"))
# No -march: each function names the instructions it needs (simd.h), and available()
# checks the CPU has them. fp-contract=off: elementwise.c rounds like torch, unfused.
COMPILE = ["-O3", "-fopenmp", "-fPIC", "-std=gnu11", "-ffp-contract=off"]
CPU_FLAGS = {torch.float32: frozenset({"avx512f", "avx512bw", "avx512vl"}),
             torch.bfloat16: frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})}
# quant.c's AVX-512 tiles (int8 x int8 products by vpdpbusd): also AVX512_VNNI
VNNI_FLAGS = CPU_FLAGS[torch.float32] | {"avx512_vnni"}

_p, _i64, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    # (x, M, K, panels, N, bias or NULL, y)
    "zs_linear_f32": [_p, _i64, _i64, _p, _i64, _p, _p],
    "zs_linear_bf16": [_p, _i64, _i64, _p, _i64, _p, _p],
    # the same panels on AVX2: (bf16, x, M, K, panels, N, bias or NULL, y)
    "zs_linear_avx2": [_int, _p, _i64, _i64, _p, _i64, _p, _p],
    # LoRA runs (linear.c): (avx512, x, K, y, N, runs, nruns, table)
    "zs_lora_f32": [_int, _p, _i64, _p, _i64, _p, _i64, _p],
    # (bf16, KV kind, q, q row stride, kv, int8 scales or NULL, table, ctx, rows, lens, B, H,
    # Hkv, D, scale, out)
    "zs_decode_attention": [_int, _int, _p, _i64, _p, _p, _p, _i64, _p, _p, _i64, _i64, _i64,
                            _i64, _float, _p],
    # the same on AVX2, same arguments
    "zs_decode_attention_avx2": [_int, _int, _p, _i64, _p, _p, _p, _i64, _p, _p, _i64, _i64,
                                 _i64, _i64, _float, _p],
    # (model, M, x, r, positions, table, ctx, rows, lens, slots, y, qkv, att, gu, act) -> 0,
    # or -1: out of memory (decode.c)
    "zs_decode_layers": [_p, _i64, _p, _p, _p, _p, _i64, _p, _p, _p, _p, _p, _p, _p, _p],
    # (bf16, KV kind, kv, int8 scales or NULL, slots, N, k, v, k/v row stride, Hkv * D)
    "zs_kv_write": [_int, _int, _p, _p, _p, _i64, _p, _p, _i64, _i64],
    # (bf16, x, residual or NULL, h out or NULL, weight, eps, M, D, y)
    "zs_add_rms_norm": [_int, _p, _p, _p, _p, _float, _i64, _i64, _p],
    # (bf16, x, M, row stride, heads, D, cos_sin, positions)
    "zs_rope": [_int, _p, _i64, _i64, _i64, _i64, _p, _p],
    # (bf16, gate_up, M, I, y)
    "zs_silu_mul": [_int, _p, _i64, _i64, _p],
    # the same three on AVX2, same arguments
    "zs_add_rms_norm_avx2": [_int, _p, _p, _p, _p, _float, _i64, _i64, _p],
    "zs_rope_avx2": [_int, _p, _i64, _i64, _i64, _i64, _p, _p],
    "zs_silu_mul_avx2": [_int, _p, _i64, _i64, _p],
    # (AVX-512 VNNI, ggml type, x, M, K, weight groups, N, bias or NULL, y, y row stride)
    # -> 0, or -1: out of memory
    "zs_linear_quant": [_int, _int, _p, _i64, _i64, _p, _i64, _p, _p, _i64],
    # (ggml type, x, M, K, weight groups, N, bias or NULL, y, y row stride) -> 0, or -1
    # (blocks.c: float activations)
    "zs_linear_blocks_avx2": [_int, _p, _i64, _i64, _p, _i64, _p, _p, _i64],
    "zs_linear_blocks_avx512": [_int, _p, _i64, _i64, _p, _i64, _p, _p, _i64],
    # (ggml type, weight groups, N, K, int64 ids, n, out) -> 0, or -1: an id outside
    # [0, N) (blocks.c: an embedding's rows)
    "zs_dequant_rows_avx2": [_int, _p, _i64, _i64, _p, _i64, _p],
    "zs_dequant_rows_avx512": [_int, _p, _i64, _i64, _p, _i64, _p],
    # (ZsBlocks *, x, M, K, bias or NULL, y) -> 0, or -1 (blocks.c: a layer in parts)
    "zs_linear_parts": [_p, _p, _i64, _i64, _p, _p],
    # (requests in this model step, or 0: none) (blocks.c: the int8 rule's batch)
    "zs_set_step_batch": [_i64],
}
RESTYPES = {"zs_lora_f32": _int, "zs_linear_quant": _int, "zs_decode_layers": _int, "zs_linear_blocks_avx2": _int,
            "zs_linear_blocks_avx512": _int, "zs_linear_parts": _int,
            "zs_dequant_rows_avx2": _int, "zs_dequant_rows_avx512": _int}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built once per source version; None if they cannot be built."""
    return build_library(default_cache_root() / "kernels", os.environ.get("CC", "cc"))


def build_library(out_dir: pathlib.Path, cc: str) -> ctypes.CDLL | None:
    """Compile (unless out_dir already holds this version) and load the kernels."""
    digest = hashlib.sha256(" ".join([cc, *COMPILE]).encode())
    for src in SOURCES + HEADERS:
        digest.update(src.name.encode() + src.read_bytes())
    lib_path = out_dir / f"zserve-cpu-{digest.hexdigest()[:16]}.so"
    try:
        if not lib_path.exists():
            out_dir.mkdir(parents=True, exist_ok=True)
            # Build beside the target, then rename: concurrent builders never see half a file.
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
            os.close(fd)
            log.info("compiling zserve's CPU kernels into %s (once per version of their "
                     "sources: about half a minute on 2 cores)", out_dir)
            try:
                compile_into(cc, tmp)
                os.replace(tmp, lib_path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        lib = ctypes.CDLL(str(lib_path))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("zserve CPU kernels unavailable, using torch's: %s",
                    getattr(e, "stderr", "") or e)
        return None
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, RESTYPES.get(name)
    return lib


def compile_into(cc: str, lib_path: str) -> None:
    """Compile every source into an object, as many at once as the machine has cores (the
    largest, blocks.c, takes most of the time), then link them into lib_path."""
    def run(argv: list[str]) -> None:
        subprocess.run(argv, check=True, capture_output=True, text=True, timeout=300)

    with tempfile.TemporaryDirectory(prefix="zserve-kernels-") as objs:
        outs = [os.path.join(objs, src.stem + ".o") for src in SOURCES]
        jobs = [[cc, *COMPILE, "-c", str(src), "-o", out]
                for src, out in zip(SOURCES, outs)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(run, jobs))               # the first failure raises here
        run([cc, "-shared", "-fopenmp", "-o", lib_path, *outs, "-lm"])


def available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Can this device and dtype run on our AVX-512 kernels, and may they (wire/cpu.py:
    ZSERVE_CPU_KERNELS, ZSERVE_CPU_ISA)?"""
    return (torch.device(device).type == "cpu" and dtype in CPU_FLAGS
            and runs_avx512_kernels(CPU_FLAGS[dtype]) and library() is not None)


def vnni_available(device: torch.device | str) -> bool:
    """Does quant.c's int8 kernel run its AVX-512 VNNI tiles here (else its AVX2 ones)?
    The same switches as `available`; the AVX2 kernels are needed too (quant.c rounds x
    with them)."""
    return (torch.device(device).type == "cpu" and runs_avx512_kernels(VNNI_FLAGS)
            and avx2_available(device))


def avx2_available(device: torch.device | str) -> bool:
    """Can this device run the AVX2 kernels (quant.c, and the *_avx2 functions)?"""
    return (torch.device(device).type == "cpu" and runs_avx2_kernels()
            and library() is not None)


def _avx2_serves(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Do the *_avx2 versions take over for this dtype (float32 and bfloat16)?"""
    return dtype in CPU_FLAGS and avx2_available(device)


def linear_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Can linear layers of this dtype run on linear.c (AVX-512, or its AVX2 version for
    float32 and bfloat16)?"""
    return available(device, dtype) or _avx2_serves(device, dtype)


def function(name: str, device: torch.device | str, dtype: torch.dtype):
    """attention.c's or elementwise.c's function `name` for this device and dtype, with its
    leading dtype flag bound: the AVX-512 version, else its AVX2 version (`name`_avx2), else
    None (torch serves)."""
    if available(device, dtype):
        fn = getattr(library(), name)
    elif _avx2_serves(device, dtype):
        fn = getattr(library(), name + "_avx2")
    else:
        return None
    return functools.partial(fn, int(dtype == torch.bfloat16))
