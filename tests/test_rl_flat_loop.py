"""recipes/addition/rl_loop.py, the flat loop on the bare client API, against the library: on the
tiny model, with the same task, settings and seeds, it samples the same replies, keeps the same
groups and scores the same held-out accuracy as ``run_rl`` on ``--task addition``, step for step."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from opentinker.client import ServiceClient
from opentinker.renderers import ChatMLRenderer
from opentinker.rl import RLConfig, run_rl
from opentinker.service.runtime import Runtime
from opentinker.tasks.arithmetic import AdditionDataset, make_evaluator
from tests.conftest import TEST_MODEL

ROOT = Path(__file__).resolve().parents[1]


def test_flat_addition_loop_runs_as_the_library_does(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENTINKER_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, str(ROOT / "recipes/addition/rl_loop.py"), "--model", TEST_MODEL, "--steps", "3",
           "--eval-every", "2", "--eval-problems", "8"]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600, env=env).stdout
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    start, steps, summary = lines[0], lines[1:-1], lines[-1]
    assert [r["step"] for r in steps] == [1, 2, 3] and summary["steps"] == 3
    assert summary["eval/accuracy_start"] == start["eval/accuracy"]
    assert summary["eval/accuracy_end"] == steps[-1]["eval/accuracy"]

    service = ServiceClient(runtime=Runtime(tmp_path / "data", max_rank=16))
    renderer = ChatMLRenderer(service.create_sampling_client(base_model=TEST_MODEL).get_tokenizer())
    cfg = RLConfig(
        base_model=TEST_MODEL, log_dir=str(tmp_path / "lib"), steps=3, groups_per_step=4, group_size=8,
        lora_rank=8, learning_rate=3e-4, max_tokens=8, eval_every=2, progress=False,
    )  # fmt: skip
    dataset = AdditionDataset(renderer, cfg.groups_per_step, cfg.group_size, seed=cfg.seed)
    res = asyncio.run(run_rl(cfg, service, dataset, make_evaluator(renderer, n=8)))
    lib = res.metrics
    assert [r["reward/mean"] for r in steps] == [r["reward/mean"] for r in lib]
    assert [r["train/datums"] for r in steps] == [r["train/datums"] for r in lib]
    assert any(r["train/datums"] > 0 for r in steps)  # it did train
    # held-out accuracy at the start, after step 2 and at the end
    assert [start["eval/accuracy"], steps[1]["eval/accuracy"], steps[2]["eval/accuracy"]] == [
        r["eval/accuracy"] for r in lib
    ]
