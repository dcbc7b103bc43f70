#!/usr/bin/env bash
# Create (or re-use) a separate virtualenv holding DeepSpeed, for the peer benchmarks in
# tools/peers/. DeepSpeed is NOT a dependency of infinity and must never be installed into
# the project's .venv.
#
#   tools/setup_deepspeed_venv.sh [VENV]        # default VENV: /tmp/infinity-dsvenv
#
# Idempotent: an existing venv whose `import deepspeed` already works is left as it is.
# The CPU build of torch is installed FIRST (from the local wheel directory pip is configured
# with, if any): otherwise resolving deepspeed would pull a multi-GB CUDA torch.
set -euo pipefail

VENV="${1:-/tmp/infinity-dsvenv}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
DEEPSPEED_VERSION="${DEEPSPEED_VERSION:-0.19.8}"
PYTHON="${PYTHON:-python3}"

log() { echo "[setup_deepspeed_venv] $*" >&2; }

case "$(cd "$(dirname "$VENV")" 2>/dev/null && pwd)/$(basename "$VENV")" in
  */.venv) log "refusing to install DeepSpeed into a project .venv ($VENV)"; exit 2 ;;
esac

# DeepSpeed's async I/O op (AsyncIOBuilder, used by NVMe offload) JIT-compiles against libaio.
if [ ! -e /usr/include/libaio.h ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing libaio-dev (needed by DeepSpeed's AsyncIOBuilder)"
    apt-get update -qq >&2 && apt-get install -y -qq libaio-dev >&2
  else
    log "WARNING: /usr/include/libaio.h missing; DeepSpeed NVMe offload will not build." \
        "Install libaio-dev (Debian/Ubuntu) or libaio-devel (RHEL) as root."
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

check() {
  "$PY" - "$TORCH_VERSION" "$DEEPSPEED_VERSION" <<'PYEOF' 2>/dev/null
import sys
import torch, deepspeed
want_torch, want_ds = sys.argv[1], sys.argv[2]
ok = torch.__version__.split("+")[0] == want_torch and deepspeed.__version__ == want_ds
print(f"torch {torch.__version__} (cuda={torch.version.cuda}), deepspeed {deepspeed.__version__}")
sys.exit(0 if ok else 1)
PYEOF
}

if check >&2; then
  log "already set up: $VENV"
  echo "$PY"
  exit 0
fi

PIP=("$PY" -m pip install --disable-pip-version-check)
"${PIP[@]}" -q --upgrade pip setuptools wheel >&2 || log "pip/setuptools upgrade failed; continuing"

# 1. CPU torch first. Prefer a local +cpu wheel; else PyTorch's CPU index is NOT reachable here,
#    so fall back to the plain version pin (which pip resolves from the configured indexes).
WHEEL=""
for d in ${PIP_FIND_LINKS:-} /opt/wheels; do
  [ -d "$d" ] || continue
  w=$(ls "$d"/torch-"$TORCH_VERSION"+cpu-*.whl 2>/dev/null | head -n1 || true)
  if [ -n "$w" ]; then WHEEL="$w"; break; fi
done
if [ -n "$WHEEL" ]; then
  log "installing CPU torch from $WHEEL"
  "${PIP[@]}" "$WHEEL" >&2
else
  log "no local +cpu wheel found; installing torch==$TORCH_VERSION from the configured index"
  "${PIP[@]}" "torch==$TORCH_VERSION" >&2
fi

# 2. DeepSpeed and what its import / JIT op builds need. torch is pinned so pip keeps the CPU build.
log "installing deepspeed==$DEEPSPEED_VERSION"
"${PIP[@]}" "torch==$TORCH_VERSION" "deepspeed==$DEEPSPEED_VERSION" \
  py-cpuinfo ninja numpy packaging psutil hjson msgpack pydantic tqdm >&2

# 3. Verify.
if ! check >&2; then
  log "verification failed: 'import deepspeed' does not work in $VENV (or wrong versions)"
  "$PY" -c "import deepspeed" >&2 || true
  exit 1
fi
log "ok: $VENV"
echo "$PY"
