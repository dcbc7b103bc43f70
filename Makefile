# The two quick-start commands are `make demo` and `make test`; both set
# themselves up (scripts/setup.sh is idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test test-slow test-gpu bench clean

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

clean:
	rm -rf build *.egg-info infinity/*.so .setup-stamp
