#!/usr/bin/env bash
# The test command: lint, format check, type check, then the test suite twice: every tier on one
# thread, and the default tier (`pytest` alone) on torch's default thread count, which splits every
# reduction another way (tests/tolerances.py).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
# a test skipped for a missing extra fails (tests/conftest.py): scripts/install.sh installs them all
export OPENTINKER_NO_SKIPS=1
"$BIN/ruff" check src tests benchmarks scripts recipes
"$BIN/ruff" format --check src tests benchmarks scripts recipes
"$BIN/pyright" --pythonpath "$BIN/python" src
# every tier, the slow SmolLM2 ones too (they fit CI's time); `pytest` alone skips them
echo "== pytest, OMP_NUM_THREADS=1"
OMP_NUM_THREADS=1 "$BIN/python" -m pytest -m "slow or not slow" "$@"
echo "== pytest, default thread count, default tier"
env -u OMP_NUM_THREADS "$BIN/python" -m pytest "$@"
