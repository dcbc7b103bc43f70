# The two quick-start commands are `make demo` and `make test`; both set
# themselves up (scripts/setup.sh is idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test test-slow test-gpu gpu-check bench clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/infinity finetune

test: setup
	@bash scripts/run_tests.sh -m "not slow" $(PYTEST_ARGS)

test-slow: setup
	@bash scripts/run_tests.sh -m slow $(PYTEST_ARGS)

# tests/gpu/ on a CUDA machine (one line "skipped" elsewhere)
test-gpu: setup
	@bash scripts/test_gpu.sh $(PYTEST_ARGS)

# the prepared run for a lent GPU machine (tools/gpu_check.sh; no .venv, no network there):
# `make gpu-check DIR=out PART=core`; without a GPU it runs the same steps in dry mode
DIR ?= gpu-check-out
PART ?= core
gpu-check:
	@bash tools/gpu_check.sh $(DIR) --part $(PART)

clean:
	rm -rf build *.egg-info infinity/*.so .setup-stamp
