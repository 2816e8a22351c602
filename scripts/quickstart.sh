#!/usr/bin/env bash
# Quick start, step 1: install, then compile and run examples/attention.tdsl and
# check it against torch (on CPU it runs through Triton's interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec "${PYTHON:-python3}" examples/quickstart.py "$@"
