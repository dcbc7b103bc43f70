#!/usr/bin/env bash
# `make test-gpu`: the GPU suite (tests/gpu/: one GPU, then every GPU of the node as
# torchrun ranks). Without a CUDA device it says so in one line and succeeds: the GPU
# path is written and tested through simulated devices until a GPU machine runs this.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${INFINITY_VENV:-.venv}
if ! "$VENV/bin/python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "test-gpu: skipped: no CUDA device (torch.cuda.is_available() is False)"
    exit 0
fi
exec bash scripts/run_tests.sh tests/gpu "$@"
