#!/usr/bin/env bash
# Quick start, step 1: install (see bootstrap.sh: the project's .venv unless PYTHON is
# given), then compile and run examples/attention.tdsl and check it against torch (on
# CPU it runs through Triton's interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(scripts/bootstrap.sh)
exec "$PY" examples/quickstart.py "$@"
