#!/usr/bin/env bash
# Runs pytest in the project's virtual env. pytest exit code 5 ("no tests
# collected") is reported as a failure: a suite that ran nothing is not green.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${INFINITY_VENV:-.venv}
"$VENV/bin/python" -m pytest "$@"
rc=$?
if [ $rc -eq 5 ]; then
    echo "run_tests: pytest collected no tests: failing" >&2
    exit 1
fi
exit $rc
