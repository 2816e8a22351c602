#!/usr/bin/env bash
# Quick start, step 2: install, then run the default test suite (both CPU cores).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec "${PYTHON:-python3}" -m pytest -n auto -q "$@"
