#!/usr/bin/env bash
# Install tiledsl (editable) and what it needs into the current Python ($PYTHON or python3).
# Torch comes first: without a GPU we take the CPU build, because a bare `torch`
# requirement would pull several GB of CUDA packages.
set -euo pipefail
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "$PY" -m pip install -q --root-user-action=ignore torch
    else
        "$PY" -m pip install -q --root-user-action=ignore torch==2.13.0 \
            || "$PY" -m pip install -q --root-user-action=ignore torch --index-url https://download.pytorch.org/whl/cpu
    fi
fi
if ! "$PY" -c "import tiledsl, pytest, filecheck, xdist" >/dev/null 2>&1 \
        || [ pyproject.toml -nt .bootstrap-stamp ]; then
    "$PY" -m pip install -q --root-user-action=ignore -e ".[dev]"
    touch .bootstrap-stamp
fi
