# Two commands: `make serve` (serve the built-in tiny model) and `make test` (the test suite).
# Both create .venv when missing and install the project; on a machine without an NVIDIA GPU
# they install the CPU build of torch first (GPU users bring their CUDA build of torch).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
SERVE_ARGS ?=
PYTEST_ARGS ?=
LINT_PATHS := $(wildcard safeserve tests kernels)

.PHONY: serve test lint format clean install install-test

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(PY)
	@if ! $(PY) -c "import torch" >/dev/null 2>&1; then \
	  if [ -z "$(HAS_GPU)" ]; then $(PY) -m pip install -q $(TORCH_CPU); \
	  else echo "GPU found: install your CUDA build of torch into $(VENV), or pip will pick one"; fi; \
	fi
	@touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -q -e .
	@touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -q -e '.[test]'
	@touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

serve: $(VENV)/.installed
	$(VENV)/bin/safeserve serve $(SERVE_ARGS)

test: $(VENV)/.installed-test
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/ruff check $(LINT_PATHS)

format: $(VENV)/.installed-test
	$(VENV)/bin/ruff format $(LINT_PATHS)
	$(VENV)/bin/ruff check --fix $(LINT_PATHS)

clean:
	rm -rf $(VENV) .pytest_cache
