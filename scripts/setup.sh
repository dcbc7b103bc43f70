#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian machine (and CI): system headers,
# a virtual env with the CPU build of torch, the package in editable mode,
# and both C++ extensions built in place. Safe to run again: it only does
# what is missing, then rebuilds the extensions incrementally.
#
# Long steps (installing torch, the dependencies, building the extensions) print a
# progress line every ${INFINITY_PROGRESS_EVERY:-10} s, so a fresh machine's minutes of
# set-up are never silent. `source scripts/setup.sh` only defines the functions.
log() { echo "[setup] $*" >&2; }

# progress "what" cmd args...: run cmd, saying every N s that it is still running and,
# at the end, how long it took; returns cmd's exit status.
progress() {
    local what=$1 short=${1%% (*}; shift
    local every=${INFINITY_PROGRESS_EVERY:-10} start=$SECONDS pid rc=0
    log "$what ..."
    "$@" &
    pid=$!
    while ! wait_for "$pid" "$every"; do
        log "  ... still $short ($((SECONDS - start)) s)"
    done
    wait "$pid" || rc=$?
    if [ "$rc" = 0 ]; then log "  done: $short ($((SECONDS - start)) s)"; else log "  FAILED: $short (exit $rc)"; fi
    return "$rc"
}

# wait_for pid seconds: true once pid has exited, false after `seconds` if it has not.
wait_for() {
    local pid=$1 i
    for ((i = 0; i < $2 * 10; i++)); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    ! kill -0 "$pid" 2>/dev/null
}

if [ "${BASH_SOURCE[0]}" != "$0" ]; then return 0; fi   # sourced: functions only

set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${INFINITY_VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_VERSION=${INFINITY_TORCH_VERSION:-2.13.0}

# 0. a C++ compiler, the Python headers and venv: a fresh Debian may lack them.
need=()
command -v g++ >/dev/null || need+=(g++)
"$PY" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    || need+=(python3-dev)
"$PY" -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        log "installing ${need[*]}"
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}") >&2
    else
        log "ERROR: missing ${need[*]} (needed to build the C++ extensions)."
        log "       Ask an administrator to run: apt-get install ${need[*]}   (then re-run this script)"
        exit 1
    fi
fi

# 1. liburing headers (io_uring engine). Without them we still build (POSIX engine).
if [ ! -e /usr/include/liburing.h ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        log "installing liburing-dev (io_uring engine headers)"
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq liburing-dev) >&2 \
            || log "WARNING: apt-get install liburing-dev failed; building the POSIX I/O engine only"
    else
        log "WARNING: liburing-dev is missing and we are not root: the io_uring engine will not be built."
        log "         Ask an administrator to run: apt-get install liburing-dev   (then re-run this script)"
    fi
fi
# fio is only needed by the benchmarks (tools/bench_io_vs_fio.py); best effort.
if ! command -v fio >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ -n "${INFINITY_WITH_FIO:-}" ]; then
    (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio) >&2 || log "fio not installed (benchmarks only)"
fi

# 2. virtual env
if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtual env $VENV"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip --disable-pip-version-check -q)

# 3. torch: the pinned CPU build first, unless a (CUDA) torch is already there.
if ! "$VPY" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null; then
        progress "installing torch==$TORCH_VERSION (a few minutes on a fresh machine)" \
            "${PIP[@]}" install "torch==$TORCH_VERSION"
    else
        # no GPU: the CPU build (PyPI's default Linux wheel is the multi-GB CUDA one); a
        # local +cpu wheel (pip find-links) wins too. The CPU index is only added when it
        # answers within 5 s, so an offline machine does not wait on retries per package.
        CPU_INDEX=https://download.pytorch.org/whl/cpu
        what="installing torch==$TORCH_VERSION, CPU build (about 2 minutes on a fresh machine)"
        if "$VPY" -c "import urllib.request as u; u.urlopen('$CPU_INDEX/', timeout=5)" 2>/dev/null; then
            progress "$what" "${PIP[@]}" install "torch==$TORCH_VERSION" --extra-index-url "$CPU_INDEX" \
                --timeout 30 --retries 2
        else
            progress "$what" "${PIP[@]}" install "torch==$TORCH_VERSION"
        fi
    fi
fi

# 4. build tools + runtime deps, then the package itself (editable, no build isolation:
#    the build needs only setuptools and pybind11, never torch).
STAMP=.setup-stamp
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ setup.py -nt "$STAMP" ]; then
    progress "installing build tools" "${PIP[@]}" install "setuptools>=64" wheel "pybind11>=2.10" pytest
    # the test extra (trl, peft, accelerate, datasets for tests/integrations): torch is
    # already installed above, so the resolver keeps it (never a CUDA wheel on a CPU box)
    progress "installing infinity and its dependencies (transformers, safetensors, matplotlib; test extra: trl, peft, accelerate, datasets)" \
        "${PIP[@]}" install --no-build-isolation -e ".[test]" >&2
    "$VPY" -c "import torch, sys; v = torch.__version__; print('[setup] torch', v, file=sys.stderr)"
    touch "$STAMP"
fi

# 4b. the docs site's tools (tests/test_docs_site.py builds it with --strict; it skips
#     without them). Only what is missing; best effort, as nothing else needs them.
if ! "$VPY" -c "import mkdocs, material, mkdocstrings_handlers.python, mkdocs_include_markdown_plugin" 2>/dev/null; then
    progress "installing the docs tools (mkdocs, Material, mkdocstrings)" \
        "${PIP[@]}" install "mkdocs==1.6.1" "mkdocs-material==9.8.2" "mkdocstrings[python]==1.0.8" \
        "mkdocstrings-python==2.0.11" "mkdocs-include-markdown-plugin==7.3.0" >&2 \
        || log "WARNING: the docs tools did not install; tests/test_docs_site.py will skip"
fi

# 5. (re)build the extensions in place; incremental when sources are unchanged.
build_ext() { "$VPY" setup.py -q build_ext --inplace >/dev/null 2>/tmp/infinity-build.$$.log; }
progress "building the C++ extensions (incremental: seconds when unchanged)" build_ext \
    || { cat /tmp/infinity-build.$$.log >&2; rm -f /tmp/infinity-build.$$.log; exit 1; }
grep -i "liburing" /tmp/infinity-build.$$.log >&2 || true
rm -f /tmp/infinity-build.$$.log
log "ready: $VPY"
