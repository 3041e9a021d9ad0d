#!/usr/bin/env bash
# The test command: lint, format check, type check, then the default (not slow) test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
"$BIN/ruff" check src tests benchmarks scripts
"$BIN/ruff" format --check src tests benchmarks scripts
"$BIN/pyright" --pythonpath "$BIN/python" src
"$BIN/python" -m pytest "$@"
