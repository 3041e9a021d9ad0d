"""The UNMODIFIED ``tinker-cookbook`` 0.6.1 recipe ``recipes.vlm_classifier`` (``train`` then ``eval``)
against ``opentinker serve``, on a random 2-layer Qwen3.5 with its vision tower, offline.

Both recipe entry points run as the README's commands (subprocesses, every call over HTTP), in a
working directory that holds what the recipe asks the hub for, under the same names:

- ``Qwen/Qwen3.6-35B-A3B``: the model (the server serves that folder under that name, so the
  cookbook's tokenizer, image processor and the training run's ``base_model`` agree): the random
  ``qwen3_5`` VL model of ``tests/vision.py``, with its image processor config beside it and
  ``<think>``/``</think>`` as single tokens, as in Qwen3.5's own tokenizer (the ``qwen3_5``
  renderer's response parser requires that).
- ``dpdl-benchmark/caltech101``: the dataset the recipe's ``caltech101`` option loads with
  ``datasets.load_dataset``; here an image folder (``train/<class>/*.png``, ``test/<class>/*.png``,
  whose folder names become the ``ClassLabel``) of coloured squares on grey noise: red, green,
  blue, generated offline with fixed seeds.

The held-out accuracy (``eval.py``'s exact-match of the sampled class name, greedy) must end well
above chance (1/3): the untrained model names no class at all (0.0 at step 0). The learning rate
matters on this random model: at 1e-2 LoRA learns the answer format and the class prior, then
stays at chance (the class token's NLL ln 3); at a constant 2e-3 it leaves that plateau within
100-150 steps (the recipe's default cosine decay at 2e-3 sometimes stops it on the plateau).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from opentinker.server.local import LocalServer
from tests.conftest import local_server
from tests.vision import vl_model

pytest.importorskip(
    "tinker_cookbook.recipes.vlm_classifier.train",
    reason="tinker-cookbook (pinned 0.6.1, installed --no-deps by scripts/install.sh) is not installed",
)

MODEL = "Qwen/Qwen3.6-35B-A3B"
RENDERER = "qwen3_5_disable_thinking"
DATASET = "dpdl-benchmark/caltech101"  # what the recipe's dataset=caltech101 loads
API_KEY = "tml-vlm-classifier-0001"
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}
TRAIN_PER_CLASS, TEST_PER_CLASS, SIDE = 16, 10, 128  # 128x128: 16 image tokens with PROCESSOR's bounds
# the recipe's options beyond the README's command: a run that fits a few CPU minutes
BATCH, EPOCHS, EVAL_EVERY = 8, 50, 50
TRAIN_ARGS = [
    f"batch_size={BATCH}", f"num_epochs={EPOCHS}", "learning_rate=2e-3", "lr_schedule=constant", "lora_rank=16",
    f"eval_every={EVAL_EVERY}", "n_eval=30", "max_tokens=8", "save_every=0",
]  # fmt: skip
STEPS = len(COLOURS) * TRAIN_PER_CLASS // BATCH * EPOCHS


def coloured_squares(folder: Path) -> None:
    """An image-folder dataset: a square of the class's colour (60-90% of the side, anywhere, with
    pixel noise) on grey noise; train and test drawn with different seeds."""
    import numpy as np
    from PIL import Image

    for split, per_class, seed in (("train", TRAIN_PER_CLASS, 0), ("test", TEST_PER_CLASS, 1)):
        rng = np.random.default_rng(seed)
        for name, rgb in COLOURS.items():
            (folder / split / name).mkdir(parents=True)
            for i in range(per_class):
                a = rng.integers(100, 200, (SIDE, SIDE, 3))
                s = int(rng.integers(int(0.6 * SIDE), int(0.9 * SIDE)))
                x, y = rng.integers(0, SIDE - s + 1, 2)
                a[y : y + s, x : x + s] = np.array(rgb) + rng.integers(-25, 26, (s, s, 3))
                Image.fromarray(a.clip(0, 255).astype(np.uint8)).save(folder / split / name / f"{i:03d}.png")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vlm-classifier")
    vl_model(root / MODEL, "qwen3_5")
    coloured_squares(root / DATASET)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, workdir: Path) -> Iterator[LocalServer]:
    """``opentinker serve`` started in ``workdir``, serving the folder ``Qwen/Qwen3.6-35B-A3B``."""
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        with local_server(tmp_path_factory, "vlm-srv", base_model=MODEL, threads=1) as srv:
            os.chdir(cwd)
            yield srv
    finally:
        os.chdir(cwd)


def _recipe(module: str, args: list[str], cwd: Path, env: dict[str, str]) -> str:
    cmd = [sys.executable, "-m", f"tinker_cookbook.recipes.vlm_classifier.{module}", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_vlm_classifier_train_then_eval(server: LocalServer, workdir: Path, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "TINKER_API_KEY": API_KEY,
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets"),
        "OMP_NUM_THREADS": "1",
    }
    common = [
        "dataset=caltech101",
        f"model_name={MODEL}",
        f"renderer_name={RENDERER}",
        f"base_url={server.base_url}",
    ]
    _recipe("train", [f"experiment_dir={tmp_path / 'exp'}", *common, *TRAIN_ARGS], workdir, env)

    (log_dir,) = (tmp_path / "exp").iterdir()
    steps: dict[int, dict[str, Any]] = {}
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row["step"], {}).update(row)
    assert sorted(steps) == list(range(STEPS))
    evals = {s: m for s, m in steps.items() if "accuracy" in m}  # the recipe's sampling evaluator
    assert sorted(evals) == list(range(0, STEPS, EVAL_EVERY))
    assert evals[0]["accuracy"] == 0.0  # the random model (LoRA B = 0 at step 0) names no class
    assert steps[STEPS - 1]["train_mean_nll"] < steps[0]["train_mean_nll"] / 10
    assert all(m["test/nll"] < evals[0]["test/nll"] for s, m in evals.items() if s > 0)  # the NLL evaluator

    final = json.loads((log_dir / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert final["name"] == "final"
    out = _recipe("eval", [f"model_path={final['sampler_path']}", *common], workdir, env)
    (line,) = [x for x in out.splitlines() if x.startswith("Metrics = ")]
    accuracy = ast.literal_eval(line.removeprefix("Metrics = "))["accuracy"]
    # 30 held-out images, chance 1/3: 18 right or more by guessing has probability < 1e-3
    curve = {s: (m["accuracy"], round(m["test/nll"], 3)) for s, m in evals.items()}
    print(f"held-out accuracy {accuracy}; during training (step: accuracy, test NLL) {curve}")
    assert accuracy >= 0.6, (accuracy, curve)
