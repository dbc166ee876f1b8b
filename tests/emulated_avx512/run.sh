#!/bin/bash
# `make test-avx512-emulated`: the kernel unit tests on zserve's AVX-512 kernels, emulated,
# so that a machine without AVX-512 can run the versions it cannot execute. Each kernel
# source is compiled with its AVX-512 target attributes turned into AVX2 ones and every
# intrinsic taken from SIMDe (simde-py's headers, from the package registry, cached) with
# shim.h's corrections, into a library with no AVX-512 instruction in it; the kernel test
# files then run on it with the CPU reported as AVX-512 VNNI + BF16 (emulated_avx512.py).
# Slow per call (each vector op is a C loop), exact in what the tests check: the same
# integer and float operations, lane by lane. Not part of `make test`.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
py="$root/.venv/bin/python"
cache="${ZSERVE_CACHE:-$HOME/.cache/zserve}/avx512-emulated"
simde_pkg="simde-py==0.8.2.post1"
if [ ! -e "$cache/simde/x86/avx512.h" ]; then
    mkdir -p "$cache/download"
    "$py" -m pip download --quiet --no-deps -d "$cache/download" "$simde_pkg"
    tar -xzf "$cache"/download/simde_py-0.8.2.post1.tar.gz -C "$cache/download"
    ln -sfn "$cache/download/simde_py-0.8.2.post1/simde_py/simde/simde" "$cache/simde"
fi
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
cp "$root"/models/kernels/*.c "$root"/models/kernels/*.h "$here/shim.h" "$build/"
sed -i -E 's/target\("avx512[^"]*"\)/target("avx2,fma,f16c")/' "$build"/*.c "$build"/*.h
if grep -q 'target("avx512' "$build"/*.c "$build"/*.h; then
    echo "an AVX-512 target attribute was left in the emulated build" >&2; exit 1
fi
echo "compiling the emulated AVX-512 kernels (about a minute)"
for src in "$build"/*.c; do
    cc -O1 -mavx2 -mfma -mf16c -fopenmp -fPIC -std=gnu11 -ffp-contract=off -w \
        -include shim.h -I"$build" -I"$cache" -c "$src" -o "${src%.c}.o"
done
cc -shared -fopenmp -o "$build/zserve-emulated.so" "$build"/*.o -lm
if objdump -d "$build/zserve-emulated.so" | grep -q '%zmm'; then
    echo "the emulated build holds AVX-512 instructions" >&2; exit 1
fi
cd "$root"
ZSERVE_EMULATED_KERNELS="$build/zserve-emulated.so" \
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" \
    env -u PYTHONDONTWRITEBYTECODE "$py" -m pytest -q -p emulated_avx512 \
    -m "not e2e and not slow and not cuda" -k "not smollm2" \
    tests/test_kernels_build.py tests/test_ops.py tests/test_decode_attention.py \
    tests/test_fast_decode.py tests/test_pool.py tests/test_blocks.py tests/test_quant.py "$@"
