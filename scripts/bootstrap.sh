#!/usr/bin/env bash
# Choose the Python that tiledsl runs in, install tiledsl (editable) and what it needs
# into it, and print that interpreter's path on stdout (everything else goes to stderr):
#
#     PY=$(scripts/bootstrap.sh) && "$PY" -m pytest
#
# - PYTHON=/path/to/python: that interpreter, installed into as it is.
# - no PYTHON: the project's virtual environment .venv (ignored by git), created from
#   python3 when missing. A system Python on Debian or Ubuntu refuses `pip install`
#   ("externally-managed-environment", PEP 668); a virtual environment never does, and it
#   needs nothing from the system's site-packages.
#
# Torch comes first: without a GPU we take the CPU build, because a bare `torch`
# requirement would pull several GB of CUDA packages. Re-runs install nothing while the
# imports work and pyproject.toml is older than .bootstrap-stamp.
#
# TILEDSL_BOOTSTRAP_DRY_RUN=1 decides the same way but changes nothing: it says on stderr
# what it would create and install, and prints the interpreter it would use.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=${TILEDSL_BOOTSTRAP_DRY_RUN:-}

say() { echo "bootstrap: $*" >&2; }

# Run a command, or under a dry run only say it.
run() {
    if [ -n "$DRY" ]; then
        say "would run: $*"
    else
        "$@" >&2
    fi
}

# The interpreter to install into; creates .venv when PYTHON is not given and it is missing.
choose_python() {
    if [ -n "${PYTHON:-}" ]; then
        PY=$PYTHON
        say "using $PY: PYTHON is set"
        return
    fi
    PY=$ROOT/.venv/bin/python
    # a .venv whose interpreter is gone (its base Python removed) or that has no pip (a
    # `python3 -m venv` that failed halfway) is made again in place
    if "$PY" -c "import pip" >/dev/null 2>&1; then
        say "using $PY: no PYTHON given, so the project's virtual environment .venv (set PYTHON to use another interpreter)"
        return
    fi
    local base
    base=$(command -v python3 || true)
    if [ -z "$base" ]; then
        say "no PYTHON given and no python3 on PATH to create .venv from; set PYTHON to an interpreter"
        exit 1
    fi
    say "using $PY: no PYTHON given, so a project virtual environment .venv, created now from $base (a system Python may refuse pip installs; set PYTHON to use another interpreter)"
    if ! run "$base" -m venv "$ROOT/.venv"; then
        say "python3 -m venv failed (on Debian or Ubuntu: apt-get install python3-venv); or set PYTHON to an interpreter pip may install into"
        exit 1
    fi
}

# pip install into $PY
pip_install() {
    run "$PY" -m pip install -q --root-user-action=ignore "$@"
}

# Does $PY import these modules? (false under a dry run for a .venv not made yet)
imports() {
    [ -x "$PY" ] || command -v "$PY" >/dev/null 2>&1 || return 1
    "$PY" -c "import $1" >/dev/null 2>&1
}

install_torch() {
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        pip_install "torch>=2.11,<2.16"  # a CUDA build, in pyproject.toml's range
    else
        pip_install torch==2.13.0 || pip_install torch --index-url https://download.pytorch.org/whl/cpu
    fi
}

# (called where a failure does not stop the script: each step returns its own)
install() {
    # one interpreter start (importing torch takes seconds) when everything is there already
    if imports "torch, tiledsl, pytest, filecheck, xdist" && [ .bootstrap-stamp -nt pyproject.toml ]; then
        return 0
    fi
    if ! imports torch; then
        install_torch || return 1
    fi
    if ! imports "tiledsl, pytest, filecheck, xdist" || [ pyproject.toml -nt .bootstrap-stamp ]; then
        pip_install -e ".[dev]" || return 1
        run touch .bootstrap-stamp
    fi
}

choose_python
if ! install; then
    if [ -n "${PYTHON:-}" ]; then
        say "pip cannot install into PYTHON=$PYTHON (see above); leave PYTHON unset to use the project's .venv"
    else
        say "pip cannot install into $PY (see above)"
    fi
    exit 1
fi
echo "$PY"
