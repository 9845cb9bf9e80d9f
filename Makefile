# Two commands: `make serve` (serve the built-in tiny model) and `make test` (the test suite).
# Both create .venv when missing and install the project; on a machine without an NVIDIA GPU
# they install the CPU build of torch first (GPU users bring their CUDA build of torch).
# Without a GPU, `make test` then runs the Triton kernels under Triton's CPU interpreter too.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
SERVE_ARGS ?=
PYTEST_ARGS ?=
# make test: the tests marked `serial` (tests/conftest.py: servers, killed processes, timed
# recoveries) run one at a time; the others, and the interpreter run, on this many xdist workers
# (0: none; one at a time where a GPU is found: its tests share the one device).
TEST_WORKERS ?= $(if $(HAS_GPU),0,2)
LINT_PATHS := $(wildcard safeserve tests kernels)

# The interpreter run (TRITON_INTERPRET=1, its own pytest process: the variable changes what other
# tests run). Its tests: test_interpreter_* and paged attention's decode/store/prefill kernel tests,
# and two parallel layouts' logits against transformers with every kernel on the engine's path
# (tensor-parallel attention over sharded heads; data-parallel attention with the all-to-all),
# the FP8 KV cache's logits (one rank and tp2-ep2-alltoall) with the kernels' FP8 stores, and
# block-FP8 weights through the model runner on the W8A8 kernels.
# Without a GPU, Triton and a NumPy below 2.4 go into a folder of their own on that run's
# PYTHONPATH only: Triton 3.6's interpreter fails on NumPy 2.4 (the tests also pass under 3.9's), the
# package pins neither, and the normal run keeps a CPU user's install (no Triton, newest NumPy).
# Where a GPU is found nothing is installed: the CUDA build of torch pins its own Triton.
TRITON_INTERP ?= triton==3.6.0 "numpy<2.4"
INTERP_SITE := $(VENV)/triton-interpreter
INTERP_TESTS ?= tests/kernels tests/engine/test_layouts.py tests/engine/test_fp8_kv.py \
  tests/engine/test_fp8_weights_kernels.py -m "not gpu" \
  -k "interpreter or decode_kernel or store_kernel or prefill_kernel or tp2-ep1-none] or tp2-ep2-alltoall-dp or fp8_cache_logits or fp8_cache_tp2"
# --min-passed: these tests skip where Triton is missing, and a run that only skipped must fail.
INTERP_RUN = $(PY) -m pytest -q -n $(TEST_WORKERS) --min-passed=1 $(INTERP_TESTS)
# Also without a GPU, beside the interpreter run: every Triton kernel compiled as the engine
# launches it for sm_90 (H100/H200) and sm_89 (L4/L40S; 99 KiB of shared memory, as sm_86/sm_120),
# down to a cubin, nothing run (tests/kernels/gpu_compile.py; sm_80 on request); a kernel the GPU
# compiler rejects, or a tile over a target's shared memory, fails `make test`.
COMPILE_LOG := $(VENV)/gpu-compile.log
GPU_COMPILE = PYTHONPATH=$(abspath $(INTERP_SITE)) $(PY) tests/kernels/gpu_compile.py >$(COMPILE_LOG) 2>&1
COMPILE_REPORT = if wait $$pid; then grep '^{"target"' $(COMPILE_LOG) | cut -c1-160; \
	  else cat $(COMPILE_LOG); echo "GPU compile failed (log: $(COMPILE_LOG))"; rc=1; fi
ifeq ($(HAS_GPU),)
INTERP_DEPS := $(VENV)/.installed-test $(VENV)/.triton-interpreter
INTERP_RUN := TRITON_INTERPRET=1 PYTHONPATH=$(abspath $(INTERP_SITE)) $(INTERP_RUN)
else
INTERP_DEPS := $(VENV)/.installed-test
INTERP_RUN := TRITON_INTERPRET=1 $(INTERP_RUN)
endif

.PHONY: serve test test-scenarios test-interpreter check-compile lint format clean install install-test

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

$(VENV)/.triton-interpreter: | $(PY)
	rm -rf $(INTERP_SITE)
	$(PY) -m pip install -q --target $(INTERP_SITE) $(TRITON_INTERP)
	@touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

serve: $(VENV)/.installed
	$(VENV)/bin/safeserve serve $(SERVE_ARGS)

# `make test` leaves out the whole chaos scenarios (marker `scenario`, about 4 minutes on two
# cores): `make test-scenarios` runs them, and CI runs both.
test: $(INTERP_DEPS)
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not scenario and not serial" --durations=10 $(PYTEST_ARGS)
	$(PY) -m pytest -q -m "not scenario and serial" --durations=20 $(PYTEST_ARGS)
ifeq ($(HAS_GPU),)
	@$(GPU_COMPILE) & pid=$$!; $(INTERP_RUN); rc=$$?; $(COMPILE_REPORT); exit $$rc
endif

test-scenarios: $(VENV)/.installed-test
	$(PY) -m pytest -q -m scenario --min-passed=1 $(PYTEST_ARGS)

test-interpreter: $(INTERP_DEPS)
	$(INTERP_RUN)

check-compile: $(VENV)/.installed-test $(VENV)/.triton-interpreter
	@$(GPU_COMPILE) & pid=$$!; rc=0; $(COMPILE_REPORT); exit $$rc

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/ruff check $(LINT_PATHS)

format: $(VENV)/.installed-test
	$(VENV)/bin/ruff format $(LINT_PATHS)
	$(VENV)/bin/ruff check --fix $(LINT_PATHS)

clean:
	rm -rf $(VENV) .pytest_cache
