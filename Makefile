# Two commands: `make run` sets up and opens ds4station, `make test` sets up and runs the test suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch is enough to run the demo model and the tests; on a GPU host install the CUDA or
# ROCm build of torch into $(VENV) first (see README), and `make` keeps it.
TORCH ?= torch>=2.11
# CUDA builds of torch bring triton and ROCm builds pytorch-triton-rocm (both import as `triton`); the CPU
# build brings none, and the kernels (the CPU interpreter in the tests) need it: installed only when missing,
# so it never replaces the one a GPU build of torch brought.
TRITON ?= triton>=3.6
# The oldest Triton the kernels must compile with (torch 2.11's, what the GPU image runs), installed beside
# the venv (not imported by it): tests/test_kernels_compile.py compiles every kernel with it too. Without the
# package registry the test is skipped (CI sets DS4_TRITON_MIN_REQUIRED and fails instead).
TRITON_MIN ?= triton==3.6.0
TRITON_MIN_DIR ?= $(VENV)/triton-min

$(BIN)/ds4station: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/python -m pip install -q "$(TRITON)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

# The real coding agents the tests drive (tests/agents/package.json pins them), from the npm registry into
# .agents/; Node from the distribution's packages when the machine has none.
AGENTS ?= .agents

$(TRITON_MIN_DIR)/.installed: $(BIN)/ds4station
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(TRITON_MIN_DIR) "$(TRITON_MIN)" && touch $@ \
		|| echo "make: $(TRITON_MIN) could not be installed into $(TRITON_MIN_DIR): its compile test is skipped" >&2

.PHONY: setup run test lint clean agents
setup: $(BIN)/ds4station

run: setup
	$(BIN)/ds4station $(ARGS)

test: setup $(TRITON_MIN_DIR)/.installed
	$(BIN)/ruff check ds4station tests docs/scripts
	DS4_TRITON_MIN_DIR=$(TRITON_MIN_DIR) $(BIN)/python -m pytest -n 2 --dist loadfile $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check ds4station tests docs/scripts

agents:
	command -v npm >/dev/null || (apt-get update -qq && apt-get install -y -qq nodejs npm)
	mkdir -p $(AGENTS)
	cp tests/agents/package.json $(AGENTS)/package.json
	npm install --prefix $(AGENTS) --no-audit --no-fund --loglevel=error

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
