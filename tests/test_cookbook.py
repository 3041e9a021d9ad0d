"""An UNMODIFIED ``tinker-cookbook`` RL recipe against ``opentinker serve`` (issue #5).

Runs the cookbook's own math-RL recipe entry point (``recipes.math_rl.train.cli_main``) on its
synthetic arithmetic task for a few steps, pointed at a server subprocess by the recipe's
``base_url`` setting and ``TINKER_API_KEY``; every cookbook call (session, LoRA model, sampling,
``forward_backward``, ``optim_step``, save/load of weights, final checkpoint) goes over HTTP.

The pinned cookbook is 0.6.1, installed with ``--no-deps`` (see README and scripts/install.sh).

Two settings of the recipe differ from its CLI defaults, neither touching cookbook code:

- ``model_name`` is the model's local folder. The cookbook loads its tokenizer with
  ``AutoTokenizer.from_pretrained(model_name)``, which reads a local folder offline, while the
  name ``opentinker/tiny`` would be looked up on the HF Hub. The server serves that folder as its
  base model, so one string names the model on both sides.
- ``loss_fn="importance_sampling"`` (the default of ``rl.train.Config``): the recipe's CLI default,
  ``stable_reinforce``, needs sampler stability records that this server does not produce.

Renderers: ``role_colon`` is the model-agnostic one from the issue; the tiny model, pretrained on
ChatML, never emits its ``\\n\\nUser:`` stop, so rewards are constant there. ``qwen3_instruct``
renders ChatML, so the tiny model ends answers with ``<|im_end|>`` (the format reward) and
groups get mixed rewards, i.e. non-zero advantages reach the server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tinker

from opentinker.models.registry import resolve_model_path
from opentinker.server.local import LocalServer
from tests.conftest import TEST_MODEL, local_server
from tests.tolerances import LOGPROB_ATOL

math_rl = pytest.importorskip(
    "tinker_cookbook.recipes.math_rl.train",
    reason="tinker-cookbook (pinned 0.6.1, installed --no-deps by scripts/install.sh) is not installed",
)

API_KEY = "tml-cookbook-test-key-0001"
STEPS = 3
GROUPS_PER_BATCH = 2
GROUP_SIZE = 4


@pytest.fixture(scope="module")
def model_dir() -> str:
    return resolve_model_path(TEST_MODEL)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: str) -> Iterator[LocalServer]:
    with local_server(tmp_path_factory, "srv", base_model=model_dir, threads=1) as srv:
        yield srv


def _run_recipe(server: LocalServer, model_dir: str, renderer: str, log_path: Path) -> None:
    cfg = math_rl.CLIConfig(
        model_name=model_dir,
        lora_rank=4,
        renderer_name=renderer,
        env="arithmetic",
        group_size=GROUP_SIZE,
        groups_per_batch=GROUPS_PER_BATCH,
        learning_rate=1e-4,
        max_tokens=8,
        loss_fn="importance_sampling",
        max_steps=STEPS,
        eval_every=0,
        save_every=0,
        log_path=str(log_path),
        base_url=server.base_url,
        behavior_if_log_dir_exists="raise",
    )
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        asyncio.run(math_rl.cli_main(cfg))
    finally:  # the cookbook configures the root logger; leave it as we found it
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
                h.close()
        root.setLevel(level)


@pytest.mark.parametrize("renderer", ["role_colon", "qwen3_instruct"])
def test_cookbook_math_rl_arithmetic(
    server: LocalServer, model_dir: str, renderer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    log_path = tmp_path / "log"
    _run_recipe(server, model_dir, renderer, log_path)

    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    steps: dict[int, dict[str, Any]] = {}
    for row in rows:
        steps.setdefault(row["step"], {}).update(row)
    assert sorted(steps) == [*range(STEPS), STEPS]  # one row per step, then the final token totals
    for row in rows:
        for key, value in row.items():
            if isinstance(value, float):
                assert math.isfinite(value), (key, value)

    n = GROUPS_PER_BATCH * GROUP_SIZE
    for step in range(STEPS):
        m = steps[step]
        assert m["env/all/total_episodes"] == n
        assert m["tokens/trained"] > 0 and m["tokens/sampled"] > 0
        assert -0.1 - 1e-9 <= m["env/all/reward/total"] <= 1.0 + 1e-9
        # server-side metrics of optim_step, passed through by the cookbook
        assert m["grad_norm:mean"] >= 0 and m["learning_rate:mean"] == pytest.approx(1e-4)
        assert m["optim/entropy"] > 0
        # the sampler's logprobs are the trainer's (same weights, T = 1): KL(sample || train) ~ 0
        assert (
            abs(m["optim/kl_sample_train_v1"]) < LOGPROB_ATOL and m["optim/kl_sample_train_v2"] < LOGPROB_ATOL
        )
    if renderer == "qwen3_instruct":
        assert max(steps[s]["env/all/format"] for s in range(STEPS)) > 0  # sampling stopped on <|im_end|>

    # the recipe's final checkpoint is on the server, listed under its training run
    final = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()][-1]
    assert final["name"] == "final" and final["batch"] == STEPS
    run_id = final["state_path"].removeprefix("tinker://").split("/")[0]
    rest = tinker.RestClient(base_url=server.base_url, api_key=API_KEY)
    listed = rest.list_checkpoints(run_id).result().checkpoints
    assert {final["state_path"], final["sampler_path"]} <= {c.tinker_path for c in listed}
