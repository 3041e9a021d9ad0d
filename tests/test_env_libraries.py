"""Environments of other libraries as tasks, each driven with the real library on the tiny model:
a few RL steps, and the reward equal to the library's own scoring of the same completion.
reasoning-gym (``reasoning_gym:<dataset>``) through the CLI, embedded and against a server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import reasoning_gym
from tinker import types

from opentinker.cli.main import main
from opentinker.client import ServiceClient
from opentinker.renderers import ChatMLRenderer, Renderer
from opentinker.rl import rollout_group
from opentinker.server.local import LocalServer
from opentinker.service.runtime import Runtime
from opentinker.tasks import get_task
from opentinker.tracking import read_metrics
from tests.conftest import TEST_MODEL, local_server

FAST = ["--base-model", TEST_MODEL, "--extra", "eval_problems=6", "--no-progress"]
RG = "reasoning_gym:basic_arithmetic?size=40&seed=3&max_terms=2&max_digits=2"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> ServiceClient:
    return ServiceClient(runtime=Runtime(tmp_path_factory.mktemp("envlibs"), max_rank=16))


@pytest.fixture(scope="module")
def renderer(service: ServiceClient) -> ChatMLRenderer:
    return ChatMLRenderer(service.runtime.tokenizer(TEST_MODEL))


def _cfg(**extra: Any) -> Any:
    return SimpleNamespace(groups_per_step=2, group_size=3, seed=0, max_tokens=8, extra=extra)


def _reply_tokens(renderer: Renderer, text: str) -> list[int]:
    """An assistant reply as the sampler would return it: the text and the turn's end marker."""
    return [*renderer.encode(text), renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")]


# ---------------------------------------------------------------------------------- reasoning-gym
def test_reasoning_gym_reward_is_its_score_answer(service: ServiceClient, renderer: Renderer) -> None:
    """Sampled episodes and hand-written replies (exact, inside a sentence, wrong) alike: each
    episode's reward is the dataset's own ``score_answer`` of the reply."""
    dataset, _ = get_task(RG).build()(renderer, _cfg())
    own = reasoning_gym.create_dataset("basic_arithmetic", size=40, seed=3, max_terms=2, max_digits=2)
    policy = service.create_sampling_client(base_model=TEST_MODEL)
    params = types.SamplingParams(max_tokens=8, temperature=1.0)
    checked = 0
    for b in dataset.batch(0):
        entry = b.entry
        assert entry["question"] in {e["question"] for e in own}  # the library's own entries
        g = asyncio.run(rollout_group(b, policy, params, seed=1))
        assert g.errors == 0 and len(g.trajectories) == 3
        for t in g.trajectories:
            text = renderer.parse_response(t.transitions[0].ac_T)[0]["content"]
            assert t.total_reward == own.score_answer(answer=text.strip(), entry=entry)
            checked += 1
        for text in (entry["answer"], f"It is {entry['answer']}.", "no idea"):
            env = asyncio.run(b.make_envs())[0]
            asyncio.run(env.initial_observation())
            res = asyncio.run(env.step(_reply_tokens(renderer, text)))
            assert res.done and res.reward == own.score_answer(answer=text, entry=entry)
    assert checked == 6
    assert 0 < own.score_answer(answer="It is 1.", entry={"answer": "1"}) < 1  # partial credit exists


def test_reasoning_gym_system_prompt_extracts_tagged_answers(renderer: Renderer) -> None:
    dataset, _ = get_task(RG).build()(renderer, _cfg(system_prompt="direct"))
    b = dataset.batch(0)[0]
    env = asyncio.run(b.make_envs())[0]
    ob = asyncio.run(env.initial_observation())
    assert "<answer>" in renderer.decode(ob)  # reasoning-gym's own system prompt
    res = asyncio.run(env.step(_reply_tokens(renderer, f"sure <answer>{b.entry['answer']}</answer>")))
    assert res.reward == 1.0


def test_reasoning_gym_held_out_entries_never_train(renderer: Renderer) -> None:
    dataset, _ = get_task("reasoning_gym:basic_arithmetic?size=60&seed=1&max_terms=2&max_digits=1").build()(
        renderer, _cfg(eval_problems=30)
    )
    held = {e["question"] for e in dataset.problems.held_out}
    trained = {b.entry["question"] for s in range(40) for b in dataset.batch(s)}
    assert len(held) > 5 and trained and not held & trained


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ("reasoning_gym:basic_arithmetc", "did you mean basic_arithmetic"),
        ("reasoning_gym:basic_arithmetic?size=abc&seed=1&nonsense_option=2", "bad options"),
        ("reasoning_gym:", "names no environment"),
        ("reasoning_gym:basic_arithmetic?size", "bad options"),
    ],
)
def test_reasoning_gym_bad_names_exit_2(
    tmp_path: Path, task: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["train", "rl", "--task", task, "--log-dir", str(tmp_path / "x"), "--steps", "1", *FAST])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_list_tasks_names_every_library(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "rl", "--list-tasks"]) == 0
    out = capsys.readouterr().out
    assert "addition" in out and "reasoning_gym:<dataset>" in out and "(installed)" in out


def test_reasoning_gym_cli_embedded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "rg"
    rc = main(["train", "rl", "--task", RG, "--steps", "2", "--log-dir", str(d), "--data-dir",
               str(tmp_path / "ckpt"), "--group-size", "3", "--groups-per-step", "2", *FAST])  # fmt: skip
    assert rc == 0
    rows = read_metrics(d)
    assert [r["step"] for r in rows] == [0, 1] and "eval/accuracy" in rows[-1] and "eval/score" in rows[0]
    assert all(r["env/episodes"] == 6 and r["env/errors"] == 0 for r in rows)
    assert (d / "curves.png").stat().st_size > 0 and (d / "checkpoints.jsonl").exists()
    assert "reasoning_gym:basic_arithmetic" in capsys.readouterr().out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(tmp_path_factory, "envlibs-srv", threads=1) as srv:
        yield srv


def test_reasoning_gym_cli_against_a_server_two_tasks(tmp_path: Path, server: LocalServer) -> None:
    """Two reasoning-gym datasets at once over HTTP: one adapter each, a folder each."""
    d = tmp_path / "remote"
    tasks = f"{RG},reasoning_gym:chain_sum?size=30&max_terms=2"
    rc = main(["train", "rl", "--task", tasks, "--steps", "2", "--log-dir", str(d), "--server", server.base_url,
               "--api-key", "tml-envlibs-key-0001", "--group-size", "2", "--groups-per-step", "2", *FAST])  # fmt: skip
    assert rc == 0
    runs = sorted(p.name for p in d.iterdir() if p.is_dir())
    assert runs == ["reasoning_gym_basic_arithmetic_size_40_seed_3_max_terms_2_max_digits_2",
                    "reasoning_gym_chain_sum_size_30_max_terms_2"]  # fmt: skip
    for r in runs:
        assert [x["step"] for x in read_metrics(d / r)] == [0, 1]
        index = [json.loads(x) for x in (d / r / "checkpoints.jsonl").read_text().splitlines()]
        assert index[-1]["path"].startswith("tinker://")
