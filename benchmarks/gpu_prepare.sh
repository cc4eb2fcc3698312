#!/usr/bin/env bash
# Run HERE (where pip can reach the package index) before carrying the repo to a GPU machine:
# downloads the crc32c wheels (CPython 3.10-3.13, manylinux x86_64) that async_ckpt needs and the
# GPU image lacks into .device/wheels (ignored by git). benchmarks/gpu_check.sh installs the one
# that fits its python from there, with no network. Carry the folder: carry [".device"].
#
#   bash benchmarks/gpu_prepare.sh                 # PYTHON=... to pick the pip (default: .venv, python3)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
if [ -z "${PYTHON:-}" ]; then
    for p in "$ROOT/.venv/bin/python" "$ROOT/../main/.venv/bin/python" python3; do
        if "$p" -m pip --version >/dev/null 2>&1; then PYTHON=$p; break; fi
    done
fi
PY=${PYTHON:?no python with pip found: set PYTHON}
DEST=$ROOT/.device/wheels
mkdir -p "$DEST"
# The version tested here, where installed; else what pyproject.toml allows.
SPEC=$("$PY" -c 'import importlib.metadata as m; print("crc32c==" + m.version("crc32c"))' 2>/dev/null || echo "crc32c>=2.4")
for v in 3.10 3.11 3.12 3.13; do
    timeout 120 "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$v" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$DEST" "$SPEC"
done
ls -l "$DEST"
echo "carry .device: run tool call with carry [\".device\"]"
