#!/usr/bin/env bash
# The test command: lint, format check, type check, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
"$BIN/ruff" check src tests benchmarks scripts recipes
"$BIN/ruff" format --check src tests benchmarks scripts recipes
"$BIN/pyright" --pythonpath "$BIN/python" src
# every tier, the slow SmolLM2 ones too (they fit CI's time); `pytest` alone skips them
"$BIN/python" -m pytest -m "slow or not slow" "$@"
