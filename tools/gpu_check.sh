#!/usr/bin/env bash
# `make gpu-check`: the prepared run for a lent GPU machine (one NVIDIA GPU, no network, its
# own python3 with CUDA torch, no .venv).
#
#   tools/gpu_check.sh DIR [--part core|nvme|diag|lora|small[,...]] [--budget-s S]
#
# 1. picks the Python: $PYTHON, else python3 when it sees a CUDA device (GPU mode), else the
#    project's .venv (dry mode: simulated device, toy sizes; the first line says so);
# 2. unpacks the carried Debian packages (.gpu-carry/deb: liburing, libaio) into a private
#    prefix and installs the carried wheels (.gpu-carry/whl: DeepSpeed and what the image
#    lacks) into a private folder; starts the JIT build of DeepSpeed's CPU Adam in the
#    background (GPU mode);
# 3. builds the C++ extensions for that Python into a temporary directory (never over the
#    extensions a running test has loaded), the io_uring engine where liburing's headers can
#    be had, the POSIX engine otherwise (said in the log);
# 4. runs the part's steps (tools/gpu_check.py run), each in its own process under its own
#    time limit, and writes DIR/log.txt, DIR/summary.json, DIR/profile.png, DIR/figures.png
#    and DIR/extra.tar.gz (at most 8 files come back from the device machine).
# Exit status: 0 in GPU mode (the files must come back whatever failed); in dry mode 1 when
# the build or a step failed.
set -uo pipefail
usage() { echo "usage: tools/gpu_check.sh DIR [--part core|nvme|diag|lora|small[,...]] [--budget-s SECONDS]" >&2; exit 2; }
[ $# -ge 1 ] || usage
DIR=$1; shift
PART=core
BUDGET=
while [ $# -gt 0 ]; do
    case $1 in
        --part) PART=${2:-}; shift 2 || usage ;;
        --budget-s) BUDGET=${2:-}; shift 2 || usage ;;
        *) usage ;;
    esac
done
for p in ${PART//,/ }; do
    case $p in core|nvme|diag|lora|small) ;; *) echo "gpu_check: --part must be core, nvme, diag, lora or small (or several joined by commas: core,lora), got '$PART'" >&2; exit 2 ;; esac
done
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$DIR" || { echo "gpu_check: cannot create $DIR" >&2; exit 2; }
DIR=$(cd "$DIR" && pwd)
: >"$DIR/log.txt"
exec > >(tee -a "$DIR/log.txt") 2>&1

has_cuda() { "$1" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif command -v python3 >/dev/null && has_cuda python3; then
    PY=python3
elif [ -x "$ROOT/.venv/bin/python" ]; then
    PY=$ROOT/.venv/bin/python
else
    PY=python3
fi
if has_cuda "$PY"; then MODE=gpu; else MODE=dry; fi
if [ "$MODE" = dry ]; then
    echo "gpu-check: DRY MODE: no CUDA device for $PY: simulated device (INFINITY_SIMULATE_DEVICE=1), toy sizes; no figure here is a GPU figure"
else
    echo "gpu-check: GPU MODE: $($PY -c 'import torch; print(torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)')"
fi
[ -n "$BUDGET" ] || BUDGET=$([ "$PART" = core ] && echo 360 || echo 540)
echo "gpu-check: part $PART, budget $BUDGET s, python $PY ($($PY -c 'import sys; print(sys.version.split()[0])')), $(nproc) cpus, output $DIR"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/infinity-gpu-check.XXXXXX")
cleanup() {
    [ -n "${DS_JIT_PID:-}" ] && kill "$DS_JIT_PID" 2>/dev/null
    rm -rf "$WORK" "${INFINITY_GPU_CHECK_SWAP:-}"
}
trap cleanup EXIT
export INFINITY_GPU_CHECK_SWAP=${INFINITY_GPU_CHECK_SWAP:-$WORK/swap}
T0=$SECONDS
jobs_n=$(nproc)

# --- carried packages ---------------------------------------------------------------------
CARRY=$ROOT/.gpu-carry
if [ -d "$CARRY/deb" ] && ls "$CARRY"/deb/*.deb >/dev/null 2>&1; then
    for d in "$CARRY"/deb/*.deb; do dpkg -x "$d" "$WORK/deps" || echo "gpu-check: cannot unpack $d"; done
    export CPATH="$WORK/deps/usr/include${CPATH:+:$CPATH}"
    export LIBRARY_PATH="$WORK/deps/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export LD_LIBRARY_PATH="$WORK/deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export CFLAGS="-I$WORK/deps/usr/include${CFLAGS:+ $CFLAGS}" LDFLAGS="-L$WORK/deps/usr/lib/x86_64-linux-gnu${LDFLAGS:+ $LDFLAGS}"
    echo "gpu-check: carried packages unpacked: $(cd "$CARRY/deb" && ls *.deb | tr '\n' ' ')"
fi
if [ "$MODE" = gpu ] && ls "$CARRY"/whl/*.whl >/dev/null 2>&1; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "$CARRY"/whl/*.whl; then
        export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
        echo "gpu-check: carried wheels installed: $(cd "$CARRY/whl" && ls *.whl | tr '\n' ' ')"
        # DeepSpeed's CPU Adam JIT-compiles on first use (a minute or two): start it now, in
        # the background, so the DeepSpeed step finds it built
        (MAX_JOBS=$((jobs_n / 2)) timeout 300 "$PY" -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
            >"$WORK/ds_jit.log" 2>&1; echo "exit $?" >>"$WORK/ds_jit.log") &
        DS_JIT_PID=$!
    else
        echo "gpu-check: WARNING: the carried wheels did not install: the DeepSpeed step will say so"
    fi
fi

# --- the extensions, for this Python, into $WORK/build ---------------------------------------
echo "gpu-check: building the C++ extensions into $WORK/build ..."
bstart=$SECONDS
(cd "$ROOT" && timeout 300 "$PY" setup.py -q build --build-base "$WORK/build" -j "$jobs_n") >"$WORK/build.log" 2>&1
brc=$?
grep -i "liburing\|POSIX" "$WORK/build.log" | head -5
LIB=$(ls -d "$WORK"/build/lib* 2>/dev/null | head -1)
if [ $brc != 0 ] || [ -z "$LIB" ]; then
    echo "gpu-check: BUILD FAILED (exit $brc) after $((SECONDS - bstart)) s; last lines of the log:"
    tail -30 "$WORK/build.log"
    printf '{"build": {"ok": false, "rc": %s, "seconds": %s}}\n' "$brc" "$((SECONDS - bstart))" >"$DIR/summary.json"
    [ "$MODE" = gpu ] && exit 0 || exit 1
fi
export PYTHONPATH="$LIB${PYTHONPATH:+:$PYTHONPATH}"
ENGINE=$(cd "$WORK" && "$PY" -P -c "
import infinity, infinity._aio as a
from infinity.io.engine import uring_status
ok, why = uring_status()
print(('io_uring' if ok else 'POSIX') + ' engine (' + why + '); infinity from ' + infinity.__file__)")
echo "gpu-check: built in $((SECONDS - bstart)) s: $ENGINE"
printf '{"ok": true, "seconds": %s, "aio": "%s"}\n' "$((SECONDS - bstart))" "${ENGINE%% (*}" >"$DIR/build.json"

# --- the steps -----------------------------------------------------------------------------
left=$((BUDGET - (SECONDS - T0)))
"$PY" -P "$ROOT/tools/gpu_check.py" run --out "$DIR" --part "$PART" --mode "$MODE" --budget-s "$left"
rc=$?
rm -f "$DIR/build.json"
if [ -n "${DS_JIT_PID:-}" ]; then
    echo "gpu-check: DeepSpeed CPU Adam JIT build: $(tail -1 "$WORK/ds_jit.log" 2>/dev/null)"
fi
echo "gpu-check: done in $((SECONDS - T0)) s ($MODE mode)"
[ "$MODE" = gpu ] && exit 0 || exit $rc
