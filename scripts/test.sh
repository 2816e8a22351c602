#!/usr/bin/env bash
# Quick start, step 2: install (see bootstrap.sh: the project's .venv unless PYTHON is
# given), then run the default test suite (on every CPU core).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(scripts/bootstrap.sh)
exec "$PY" -m pytest -n auto -q "$@"
