#!/usr/bin/env sh
# The one device check of the GPU path (bench/gpu_check.py), which writes bench/results/gpu_check.json (--out to
# change it). Runs on $PYTHON, else the repository's venv, which `make install` creates where it is missing; the
# gpu extra (the CUDA quantisers' numba-cuda) is installed where a GPU is visible and it does not import.
# Arguments go to the check (--dry-run, --budget-s, --out ...).
set -eu
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
if [ ! -x "$PYTHON" ]; then
    make install >/dev/null
fi
if command -v nvidia-smi >/dev/null 2>&1 && ! "$PYTHON" -c "import numba.cuda" 2>/dev/null; then
    "$PYTHON" -m pip install -q -e ".[gpu]" || echo "gpu_check.sh: the gpu extra did not install" >&2
fi
exec "$PYTHON" -m bench.gpu_check "$@"
