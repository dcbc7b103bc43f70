#!/usr/bin/env bash
# Prepare .gpu-carry/ (git-ignored), what tools/gpu_check.sh installs on a lent GPU machine
# that has no network: DeepSpeed (no binary wheel exists: built here from its source
# distribution, pure Python, ops JIT-built there) and the wheels that machine's image lacks
# for it, for CPython 3.12 on manylinux x86-64; Debian's liburing and libaio packages
# (unpacked there into a private prefix, never over /).  Needs the network and the
# project's .venv (DeepSpeed's setup.py imports torch).  About 5 MB.
#
#   tools/prepare_gpu_carry.sh            # then: device run ... carry [".gpu-carry"]
set -euo pipefail
cd "$(dirname "$0")/.."
DS_VERSION=${DS_VERSION:-0.19.8}
# pydantic 2.13.5 + its exact pydantic-core: they need only typing-extensions >= 4.14.1,
# which the GPU image has; DeepSpeed's other requirements are in the image already
WHEELS=(pydantic==2.13.5 pydantic-core==2.46.5 annotated-types==0.8.0
        typing-inspection==0.4.2 hjson==3.1.0)
DEBS=(liburing2 liburing-dev libaio1 libaio-dev)
VPY=${PYTHON:-.venv/bin/python}
OUT=${GPU_CARRY_DIR:-.gpu-carry}
grep -qx '/.gpu-carry/' .git/info/exclude 2>/dev/null || echo '/.gpu-carry/' >>.git/info/exclude
rm -rf "$OUT" && mkdir -p "$OUT/whl" "$OUT/deb"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$VPY" -m pip download -q --no-deps --no-binary :all: "deepspeed==$DS_VERSION" -d "$tmp"
DS_BUILD_OPS=0 "$VPY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT/whl" "$tmp"/deepspeed-*.tar.gz
"$VPY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$OUT/whl" "${WHEELS[@]}"
(cd "$OUT/deb" && apt-get download "${DEBS[@]}")
ls -l "$OUT"/whl "$OUT"/deb
du -sh "$OUT"
