"""UNMODIFIED ``tinker-cookbook`` entry points against ``opentinker serve`` on the tiny model.

Each runs a cookbook recipe's own entry point for a few steps, pointed at a server subprocess by
the recipe's ``base_url`` setting (or ``TINKER_BASE_URL``) and ``TINKER_API_KEY``; every cookbook
call (session, LoRA model, sampling, ``forward_backward``, ``optim_step``, save/load of weights,
final checkpoint) goes over HTTP. The pinned cookbook is 0.6.1, installed with ``--no-deps``
(see README and scripts/install.sh).

- ``recipes.math_rl.train.cli_main`` on its synthetic arithmetic task: with the project's model
  folder and explicit renderers, and with every CLI default that matters (``stable_reinforce``,
  the renderer the cookbook picks for the model name), sync and async (``max_steps_off_policy``:
  the cookbook's async RL, whose default loss is ``stable_reinforce`` too).
- ``recipes.rl_loop.main`` with its default loss (``stable_reinforce``, provenance spans),
  resumed from a checkpoint in its log dir (the recipe's own resume path), on a small local GSM8K.
- ``recipes.decisions.demo`` (``target_prompt_logprobs``), as a subprocess reading its questions
  from stdin, checked against the same probabilities computed from the model with ``transformers``.

The cookbook only accepts model names it knows (it picks renderers, tokenizers and rollout
presets by name). Where a test needs its defaults, the tiny model is served from a folder named
like one of them, ``Qwen/Qwen3-4B-Instruct-2507``, relative to the working directory (a symlink
to the tiny model; the tokenizer is ChatML, as that renderer expects), so the same string names
the model on both sides and everything stays offline. Datasets are small local folders named
like their hub ids (``openai/gsm8k``), with the ``datasets`` cache under tmp.

Renderers in the explicit-renderer test: ``role_colon`` is the model-agnostic one; the tiny
model, pretrained on ChatML, never emits its ``\\n\\nUser:`` stop, so rewards are constant there.
``qwen3_instruct`` renders ChatML, so the tiny model ends answers with ``<|im_end|>`` (the format
reward) and groups get mixed rewards, i.e. non-zero advantages reach the server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import subprocess
import sys
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
NAMED_MODEL = "Qwen/Qwen3-4B-Instruct-2507"
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


@pytest.fixture(scope="module")
def named_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: str) -> Path:
    """A working directory holding ``Qwen/Qwen3-4B-Instruct-2507``: the tiny model under a name the
    cookbook knows (see the module docstring)."""
    root = tmp_path_factory.mktemp("named")
    (root / "Qwen").mkdir()
    (root / NAMED_MODEL).symlink_to(model_dir, target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def named_server(tmp_path_factory: pytest.TempPathFactory, named_dir: Path) -> Iterator[LocalServer]:
    """A server started in ``named_dir``, serving the tiny model as ``Qwen/Qwen3-4B-Instruct-2507``."""
    cwd = os.getcwd()
    os.chdir(named_dir)
    try:
        with local_server(tmp_path_factory, "named-srv", base_model=NAMED_MODEL, threads=1) as srv:
            os.chdir(cwd)
            yield srv
    finally:
        os.chdir(cwd)


@pytest.fixture
def in_named_dir(named_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The cookbook's side: in ``named_dir`` (so the model name is that folder), offline, with the
    test's key and a ``datasets`` cache of its own."""
    monkeypatch.chdir(named_dir)
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    # ``datasets`` reads that variable once, at import (the cookbook's import, at collection), so
    # set its config too: a shared cache serves an earlier run's ``openai/gsm8k`` by name
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    return named_dir


def _keep_root_logger(run: Any) -> None:
    """Run ``run()``; the cookbook configures the root logger, so leave it as it was found."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        run()
    finally:
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
                h.close()
        root.setLevel(level)


def _metrics(log_path: Path) -> dict[int, dict[str, Any]]:
    steps: dict[int, dict[str, Any]] = {}
    for line in (log_path / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if isinstance(value, float):
                assert math.isfinite(value), (key, value)
        steps.setdefault(row["step"], {}).update(row)
    return steps


def _final_checkpoint_listed(server: LocalServer, log_path: Path) -> dict[str, Any]:
    final = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()][-1]
    assert final["name"] == "final"
    run_id = final["state_path"].removeprefix("tinker://").split("/")[0]
    rest = tinker.RestClient(base_url=server.base_url, api_key=API_KEY)
    listed = rest.list_checkpoints(run_id).result().checkpoints
    assert {final["state_path"], final["sampler_path"]} <= {c.tinker_path for c in listed}
    return final


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


@pytest.mark.parametrize("max_steps_off_policy", [None, 1], ids=["sync", "async"])
def test_cookbook_math_rl_with_its_defaults(
    named_server: LocalServer, in_named_dir: Path, tmp_path: Path, max_steps_off_policy: int | None
) -> None:
    """math_rl with its CLI defaults: ``stable_reinforce`` (samplers record stability info, datums
    carry provenance spans), the renderer the cookbook picks for the model name, its learning
    rate, LoRA rank and max_tokens; only the run's size and where it logs are set. With
    ``max_steps_off_policy`` it is the cookbook's async RL (AsyncConfig, also ``stable_reinforce``)."""
    log_path = tmp_path / "log"
    cfg = math_rl.CLIConfig(
        model_name=NAMED_MODEL,
        groups_per_batch=GROUPS_PER_BATCH,
        max_steps=STEPS,
        max_steps_off_policy=max_steps_off_policy,
        log_path=str(log_path),
        base_url=named_server.base_url,
        behavior_if_log_dir_exists="raise",
    )
    assert cfg.loss_fn == "stable_reinforce" and cfg.renderer_name is None
    _keep_root_logger(lambda: asyncio.run(math_rl.cli_main(cfg)))

    steps = _metrics(log_path)
    assert sorted(steps) == [*range(STEPS), STEPS]
    for step in range(STEPS):
        m = steps[step]
        assert m["env/all/total_episodes"] == GROUPS_PER_BATCH * cfg.group_size
        assert m["tokens/trained"] > 0 and m["learning_rate:mean"] == pytest.approx(cfg.learning_rate)
        assert m["env/all/format"] > 0  # the cookbook's qwen3_instruct renderer: answers end on <|im_end|>
        if m["env/all/by_group/frac_mixed"] > 0:  # non-zero advantages: stable_reinforce moved the weights
            assert m["grad_norm:mean"] > 0
        if max_steps_off_policy is None or m["async/staleness_max"] == 0:  # on-policy: sampler == trainer
            assert abs(m["optim/kl_sample_train_v1"]) < LOGPROB_ATOL
    if max_steps_off_policy is not None:
        assert all("async/staleness_max" in steps[s] for s in range(STEPS))
    _final_checkpoint_listed(named_server, log_path)


def _write_gsm8k(root: Path, question: str, answer: str, n: int) -> None:
    """A local ``openai/gsm8k`` with its ``main`` config: ``n`` copies of one question."""
    folder = root / "openai" / "gsm8k"
    (folder / "main").mkdir(parents=True, exist_ok=True)
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n---\n"
    )
    row = json.dumps({"question": question, "answer": answer})
    (folder / "main" / "train.jsonl").write_text((row + "\n") * n)


# rl_loop's prompt: its fixed one-shot example, then the question with its suffix
RL_LOOP_SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
RL_LOOP_SHOT: list[Any] = [
    {"role": "user", "content": "How many r's are in strawberry?" + RL_LOOP_SUFFIX},
    {
        "role": "assistant",
        "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w 6) b "
        "7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}",
    },
]


def test_cookbook_rl_loop_with_its_default_loss(
    named_server: LocalServer, in_named_dir: Path, tmp_path: Path
) -> None:
    """recipes/rl_loop.py with its default loss, ``stable_reinforce``: provenance spans whose prompt
    targets are placeholder zeros. The tiny model never writes ``\\boxed{}`` by itself, so every
    group would have one reward and rl_loop would skip every step; the run therefore resumes (the
    recipe's own resume path, a ``checkpoints.jsonl`` in its log dir) from an adapter fine-tuned
    over HTTP to answer ``\\boxed{3}`` or ``\\boxed{4}``, which gives groups mixed rewards."""
    from tinker_cookbook import checkpoint_utils, renderers
    from tinker_cookbook.recipes import rl_loop
    from tinker_cookbook.supervised.common import datum_from_model_input_weights
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    question, batch, group, steps = "What is 1 + 2?", 2, 8, 3
    _write_gsm8k(in_named_dir, question, "1 + 2 = 3\n#### 3", n=batch * (steps + 1))
    log_path = tmp_path / "log"
    log_path.mkdir()
    service = tinker.ServiceClient(base_url=named_server.base_url)
    tc = service.create_lora_training_client(base_model=NAMED_MODEL, rank=4, seed=0).result()
    renderer = renderers.get_renderer("qwen3_instruct", get_tokenizer(NAMED_MODEL))
    data = []
    for reply in ("\\boxed{3}", "\\boxed{4}"):
        convo: list[Any] = [*RL_LOOP_SHOT, {"role": "user", "content": question + RL_LOOP_SUFFIX}]
        model_input, weights = renderer.build_supervised_example(
            [*convo, {"role": "assistant", "content": reply}]
        )
        data.append(datum_from_model_input_weights(model_input, weights))
    losses = []
    for _ in range(40):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(tinker.AdamParams(learning_rate=5e-3)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < 2.0  # -> 2 ln 2: each reply about half the time
    checkpoint_utils.save_checkpoint(
        training_client=tc, name="warm", log_path=str(log_path), kind="state", loop_state={"batch": 0}
    )

    cfg = rl_loop.Config(
        base_url=named_server.base_url,
        log_path=str(log_path),
        model_name=NAMED_MODEL,
        batch_size=batch,
        group_size=group,
        max_tokens=16,
        save_every=0,
        max_steps=steps,
    )
    assert cfg.loss_fn == "stable_reinforce"
    _keep_root_logger(lambda: rl_loop.main(cfg))

    metrics = _metrics(log_path)
    assert sorted(metrics) == list(range(steps))
    # rl_loop trains a step (and logs optim_step's metrics) only when some advantage is non-zero;
    # with rewards ~1/2 per sample, a group of 8 with one reward is rare, six of them rarer still
    trained = [s for s in range(steps) if "grad_norm:mean" in metrics[s]]
    assert trained and all(metrics[s]["grad_norm:mean"] > 0 for s in trained), metrics
    assert any(0.0 < metrics[s]["reward/total"] < 1.0 for s in range(steps))
    final = _final_checkpoint_listed(named_server, log_path)
    assert final["batch"] == steps + 1  # rl_loop records its dataset's batch count


def test_cookbook_decisions_demo(named_server: LocalServer, in_named_dir: Path) -> None:
    """The decisions demo (``target_prompt_logprobs`` at the answer position), run as its module
    with questions on stdin; each printed distribution equals a softmax over the label tokens'
    logprobs that ``transformers`` computes on the same rendering."""
    import torch
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.decisions import Decision, DecisionRenderer
    from tinker_cookbook.recipes.decisions.demo import TEAMS
    from tinker_cookbook.tokenizer_utils import get_tokenizer
    from transformers import AutoModelForCausalLM

    questions = ["How do I pick a learning rate for LoRA?", "Why was I charged twice this month?"]
    env = {**os.environ, "TINKER_BASE_URL": named_server.base_url}
    proc = subprocess.run(
        [sys.executable, "-m", "tinker_cookbook.recipes.decisions.demo", f"--model_name={NAMED_MODEL}"],
        input="\n".join(questions) + "\n\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    decoder, printed, pos = json.JSONDecoder(), [], proc.stdout.find("{")
    while pos >= 0:
        obj, end = decoder.raw_decode(proc.stdout, pos)
        printed.append(obj)
        pos = proc.stdout.find("{", end)
    assert len(printed) == len(questions)

    decision_renderer = DecisionRenderer(renderers.get_renderer("qwen3_instruct", get_tokenizer(NAMED_MODEL)))
    model = AutoModelForCausalLM.from_pretrained(NAMED_MODEL, torch_dtype=torch.float32).eval()
    for question, got in zip(questions, printed, strict=True):
        rendering = decision_renderer.render(
            Decision(
                f"A user asked the following question about Tinker:\n\n{question}\n\nWhich team should answer it?",
                TEAMS,
            )
        )
        with torch.no_grad():
            logits = model(torch.tensor([rendering.tokens])).logits[0, rendering.choice_pos - 1]
        label_ids = [rendering.label_tokens[label] for label in rendering.labels]
        want = torch.softmax(torch.log_softmax(logits.double(), -1)[label_ids], 0).tolist()
        assert list(got) == list(rendering.labels)
        # the demo prints 4 decimals: half a unit of rounding, plus fp32 noise
        for label, p in zip(rendering.labels, want, strict=True):
            assert abs(got[label] - p) <= 5e-5 + 1e-5, (question, label, got[label], p)
