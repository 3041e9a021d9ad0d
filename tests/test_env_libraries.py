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


# ---------------------------------------------------------------------------------- verifiers
def _exact(completion: Any, answer: str, **_: Any) -> float:
    """The user's reward function: the last assistant message is exactly the answer."""
    said = [m["content"] for m in completion if m["role"] == "assistant"]
    return 1.0 if said and said[-1].strip() == answer else 0.0


def _short(completion: Any, **_: Any) -> float:
    return 1.0 / (1 + len(completion[-1]["content"]))


VF_ROWS = [
    {"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(2, 3), (4, 4), (7, 1), (6, 2)]
]


def _single_turn() -> Any:
    import verifiers as vf
    from datasets import Dataset

    rubric = vf.Rubric(funcs=[_exact, _short], weights=[1.0, 0.5])
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(VF_ROWS), rubric=rubric, system_prompt="Answer with a number."
    )


def _multi_turn() -> Any:
    """Up to 3 tries; the environment says 'wrong' after a wrong one and stops after a right one."""
    import verifiers as vf
    from datasets import Dataset

    class Retry(vf.MultiTurnEnv):
        async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
            if messages[-1]["content"].strip() == state["answer"]:
                state["final_env_response"] = [{"role": "user", "content": "right"}]
                return state["final_env_response"]
            return [{"role": "user", "content": "wrong, try again"}]

    return Retry(dataset=Dataset.from_list(VF_ROWS), rubric=vf.Rubric(funcs=[_exact]), max_turns=3)


def test_verifiers_single_turn_reward_is_its_rubric(service: ServiceClient, renderer: Renderer) -> None:
    """Sampled and hand-written replies: the reward is the rubric's weighted sum of the user's
    reward functions of the same completion, each function logged as a metric."""
    from opentinker.tasks.verifiers_task import environment_task

    dataset, _ = environment_task(_single_turn(), renderer, _cfg())
    policy = service.create_sampling_client(base_model=TEST_MODEL)
    for b in dataset.batch(0):
        g = asyncio.run(rollout_group(b, policy, types.SamplingParams(max_tokens=8, temperature=1.0), seed=2))
        assert g.errors == 0 and len(g.trajectories) == 3
        for t in g.trajectories:
            text = renderer.parse_response(t.transitions[0].ac_T)[0]["content"]
            completion = [{"role": "assistant", "content": text}]
            want = _exact(completion, b.row["answer"]) + 0.5 * _short(completion)
            assert t.total_reward == pytest.approx(want, abs=1e-12)
            assert t.transitions[0].metrics["_short"] == pytest.approx(_short(completion))
        env = asyncio.run(b.make_envs())[0]
        ob = asyncio.run(env.initial_observation())
        assert "Answer with a number." in renderer.decode(ob) and b.row["question"] in renderer.decode(ob)
        res = asyncio.run(env.step(_reply_tokens(renderer, b.row["answer"])))
        assert res.done and res.reward == pytest.approx(1.0 + 0.5 / (1 + len(b.row["answer"])))


def test_verifiers_multi_turn_runs_its_env_response(renderer: Renderer) -> None:
    """Its env_response answers between turns (one token sequence), its max_turns and
    final_env_response end the episode, and its rubric scores the whole completion."""
    from opentinker.tasks.verifiers_task import environment_task

    dataset, _ = environment_task(_multi_turn(), renderer, _cfg())
    b = dataset.batch(0)[0]
    right = b.row["answer"]

    async def episode(replies: list[str]) -> tuple[list[Any], Any]:
        env = (await b.make_envs())[0]
        ob = await env.initial_observation()
        results = []
        for r in replies:
            action = _reply_tokens(renderer, r)
            res = await env.step(action)
            results.append(res)
            if res.done:
                break
            assert res.next_ob_T[: len(ob) + len(action)] == ob + action  # one growing sequence
            assert "wrong, try again" in renderer.decode(res.next_ob_T[len(ob) :])
            ob = res.next_ob_T
        return results, env

    results, _ = asyncio.run(episode(["1", "0", "9"]))  # three wrong: max_turns ends it
    assert [r.done for r in results] == [False, False, True] and results[-1].reward == 0.0
    results, env = asyncio.run(episode(["1", right, "never sent"]))  # right on the second try
    assert [r.done for r in results] == [False, True] and results[-1].reward == 1.0
    assert env.state["stop_condition"] == "has_final_env_response"


def test_verifiers_few_rl_steps(service: ServiceClient, renderer: Renderer, tmp_path: Path) -> None:
    from opentinker.rl import RLConfig, run_rl
    from opentinker.tasks.verifiers_task import environment_task

    cfg = RLConfig(base_model=TEST_MODEL, log_dir=str(tmp_path / "vf"), steps=2, groups_per_step=2, group_size=3,
                   lora_rank=4, max_tokens=6, eval_every=0, progress=False, extra={"eval_problems": 2})  # fmt: skip
    dataset, evaluator = environment_task(_multi_turn(), renderer, cfg)
    res = asyncio.run(run_rl(cfg, service, dataset, evaluator))
    assert [r["step"] for r in res.metrics] == [0, 1] and "eval/reward" in res.metrics[-1]
    assert all(r["env/errors"] == 0 and r["env/episodes"] == 6 for r in res.metrics)
    assert res.metrics[0]["env/turns_mean"] > 1  # the tiny model is wrong: it gets its retries


def test_verifiers_cli_loads_an_environment_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``verifiers:<env_id>?arg=v`` loads the module's load_environment(arg=v), as verifiers does."""
    (tmp_path / "tiny_sums_env.py").write_text(
        "import verifiers as vf\nfrom datasets import Dataset\n\n"
        "def load_environment(n: int = 3):\n"
        "    rows = [{'question': f'{i} + 1 = ?', 'answer': str(i + 1)} for i in range(n)]\n"
        "    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[lambda completion, answer, **_: float(answer in completion[-1]['content'])]))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    d = tmp_path / "run"
    rc = main(["train", "rl", "--task", "verifiers:tiny-sums-env?n=4", "--steps", "2", "--log-dir", str(d),
               "--data-dir", str(tmp_path / "ckpt"), "--group-size", "2", "--groups-per-step", "2",
               "--max-tokens", "6", *FAST])  # fmt: skip
    assert rc == 0
    assert [r["step"] for r in read_metrics(d)] == [0, 1] and "eval/reward" in read_metrics(d)[-1]
    rc = main(
        ["train", "rl", "--task", "verifiers:no-such-env-here", "--log-dir", str(tmp_path / "x"), *FAST]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "cannot load environment 'no-such-env-here'" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------- skyrl-gym
SKY = "skyrl_gym:gsm8k_multi_turn?max_turns=3&size=20"


def test_skyrl_gym_turn_rewards_are_its_step(service: ServiceClient, renderer: Renderer) -> None:
    """gsm8k_multi_turn: each turn's reward is skyrl-gym's own compute_score of that reply (strict,
    its per-turn format score), its observations are the next turn, max_turns or a right answer
    ends the episode."""
    from skyrl_gym.envs.gsm8k.utils import compute_score

    dataset, _ = get_task(SKY).build()(renderer, _cfg(eval_problems=2))
    policy = service.create_sampling_client(base_model=TEST_MODEL)
    b = dataset.batch(0)[0]
    truth = b.row["reward_spec"]["ground_truth"]
    g = asyncio.run(rollout_group(b, policy, types.SamplingParams(max_tokens=8, temperature=1.0), seed=4))
    assert g.errors == 0 and len(g.trajectories) == 3
    for t in g.trajectories:
        for tr in t.transitions:
            text = renderer.parse_response(tr.ac_T)[0]["content"]
            assert tr.reward == compute_score(text, truth, method="strict", format_score=0.2 / 3, score=1.0)
        assert len(t.transitions) == 3 or t.transitions[-1].reward == 1.0

    async def hand(replies: list[str]) -> list[Any]:
        env = (await b.make_envs())[0]
        ob = await env.initial_observation()
        assert "####" in renderer.decode(ob)  # SkyRL's answer format, asked in the prompt
        out = []
        for r in replies:
            res = await env.step(_reply_tokens(renderer, r))
            out.append(res)
            if res.done:
                return out
            assert "final numeric answer" in renderer.decode(
                res.next_ob_T
            ) or "step-by-step" in renderer.decode(res.next_ob_T)
        return out

    got = asyncio.run(hand(["#### 0", f"so #### {truth}"]))
    assert [r.done for r in got] == [False, True] and got[0].reward == pytest.approx(0.2 / 3)
    assert got[1].reward == 1.0


def test_skyrl_gym_cli_with_a_data_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rows in SkyRL's format from a JSONL file (reward_spec as a JSON string, as in its parquet)."""
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}? End with '#### N'."}],
             "reward_spec": json.dumps({"method": "rule", "ground_truth": str(2 * i)})} for i in range(6)]  # fmt: skip
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = tmp_path / "run"
    rc = main(["train", "rl", "--task", f"skyrl_gym:gsm8k_multi_turn?data={data}&max_turns=2", "--steps", "2",
               "--log-dir", str(d), "--data-dir", str(tmp_path / "ckpt"), "--group-size", "2",
               "--groups-per-step", "2", "--max-tokens", "6", *FAST])  # fmt: skip
    assert rc == 0
    m = read_metrics(d)
    assert [r["step"] for r in m] == [0, 1] and "eval/reward" in m[-1] and m[0]["env/errors"] == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "not messages", "reward_spec": {"ground_truth": "1"}}) + "\n" * 2)
    for task, message in [
        (f"skyrl_gym:gsm8k?data={bad}", "bad.jsonl, row 1: 'prompt' must be a non-empty list of messages"),
        (f"skyrl_gym:gsm8k?data={tmp_path}/none.jsonl", "no such data file"),
        ("skyrl_gym:text2sql", "needs its data"),
        ("skyrl_gym:nope", "skyrl_gym has no environment 'nope'"),
    ]:
        rc = main(["train", "rl", "--task", task, "--log-dir", str(tmp_path / "x"), *FAST])
        err = capsys.readouterr().err
        assert rc == 2 and message in err and "Traceback" not in err, err


# ---------------------------------------------------------------------------------- textarena
def test_textarena_game_is_textarenas(service: ServiceClient, renderer: Renderer) -> None:
    """TicTacToe-v0 through our multi-agent coordinator: each player's prompt is textarena's own
    observation for it, and the rewards are its close() after the same moves replayed in a fresh
    textarena game."""
    import textarena as ta

    from opentinker.rl.multiagent import play_group

    task = get_task("textarena:TicTacToe-v0").build()(renderer, _cfg(eval_games=0))
    assert task.agents == ("player0", "player1") and task.evaluator is None
    b = task.dataset.batch(0)[0]
    policies = {a: service.create_sampling_client(base_model=TEST_MODEL) for a in task.agents}
    group = asyncio.run(play_group(b, policies, types.SamplingParams(max_tokens=6, temperature=1.0), seed=5))
    assert group.errors == 0 and len(group.games) == 3
    for game in group.games:
        moves = sorted(
            (
                (i * 2 + (a == "player1"), a, tr)
                for a, t in game.trajectories.items()
                for i, tr in enumerate(t.transitions)
            ),
            key=lambda x: x[0],
        )  # TicTacToe alternates player0, player1
        ref = ta.make("TicTacToe-v0")
        ref.reset(num_players=2, seed=b.seed)
        for _, agent, tr in moves:
            pid, ob = ref.get_observation()
            assert agent == f"player{pid}" and renderer.decode(tr.ob_T).count(ob.strip()[:80]) == 1
            ref.step(renderer.parse_response(tr.ac_T)[0]["content"])
        rewards, _ = ref.close()
        assert game.rewards == {f"player{p}": float(r) for p, r in rewards.items()}


def test_textarena_cli_trains_each_player(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "ttt"
    rc = main(["train", "rl", "--task", "textarena:TicTacToe-v0", "--steps", "2", "--log-dir", str(d), "--data-dir",
               str(tmp_path / "ckpt"), "--group-size", "2", "--groups-per-step", "2", "--max-tokens", "4",
               "--base-model", TEST_MODEL, "--extra", "eval_games=2", "--no-progress"])  # fmt: skip
    assert rc == 0
    m = read_metrics(d)
    assert [r["step"] for r in m] == [0, 1] and "eval/player0/win_rate" in m[-1]
    assert all("player0/reward/mean" in r and "player1/reward/mean" in r and r["game/errors"] == 0 for r in m)
    for task, message in [("textarena:TicTacToe-v9", "did you mean TicTacToe-v0"),
                          ("textarena:TicTacToe-v0?players=5", "5 players")]:  # fmt: skip
        rc = main(["train", "rl", "--task", task, "--log-dir", str(tmp_path / "x"), *FAST])
        err = capsys.readouterr().err
        assert rc == 2 and message in err and "Traceback" not in err, err


def test_each_library_against_a_server(
    tmp_path: Path, server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verifiers, skyrl-gym and textarena tasks over HTTP through the SDK, at once (one adapter
    each, two for the game): folders, metrics and tinker:// checkpoints, as embedded."""
    (tmp_path / "tiny_sums_env2.py").write_text(
        "import verifiers as vf\nfrom datasets import Dataset\n\n"
        "def load_environment():\n"
        "    rows = [{'question': f'{i} + 1 = ?', 'answer': str(i + 1)} for i in range(4)]\n"
        "    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[lambda completion, answer, **_: float(answer in completion[-1]['content'])]))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    d = tmp_path / "remote"
    tasks = "verifiers:tiny-sums-env2,skyrl_gym:gsm8k?size=10,textarena:TicTacToe-v0"
    rc = main(["train", "rl", "--task", tasks, "--steps", "2", "--log-dir", str(d), "--server", server.base_url,
               "--api-key", "tml-envlibs-key-0001", "--group-size", "2", "--groups-per-step", "1",
               "--max-tokens", "6", "--base-model", TEST_MODEL, "--extra", "eval_problems=2",
               "--extra", "eval_games=2", "--no-progress"])  # fmt: skip
    assert rc == 0
    runs = sorted(p.name for p in d.iterdir() if p.is_dir())
    assert runs == ["skyrl_gym_gsm8k_size_10", "textarena_TicTacToe-v0", "verifiers_tiny-sums-env2"]
    for r in runs:
        assert [x["step"] for x in read_metrics(d / r)] == [0, 1]
        index = [json.loads(x) for x in (d / r / "checkpoints.jsonl").read_text().splitlines()]
        assert all(x["path"].startswith("tinker://") for x in index)
    agents = {
        json.loads(x).get("agent") for x in (d / runs[1] / "checkpoints.jsonl").read_text().splitlines()
    }
    assert agents == {"player0", "player1"}


def test_skills_recipe_script(tmp_path: Path) -> None:
    """recipes/skills/skills.py end to end on the tiny model (1 step): the accuracy matrix of the
    base model and the four adapters on the four skills, written and printed."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, str(root / "recipes/skills/skills.py"), "--base-model", TEST_MODEL, "--steps", "1",
         "--eval-problems", "2", "--log-dir", str(tmp_path / "skills")],
        capture_output=True, text=True, timeout=900, cwd=root,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads((tmp_path / "skills" / "skills.json").read_text())
    assert list(res["accuracy"]) == ["base", "add", "gcd", "count", "lcm"]
    assert all(list(row) == ["add", "gcd", "count", "lcm"] for row in res["accuracy"].values())
    assert res["steps"] == [1, 1, 1, 1] and "| base |" in out.stdout


def test_a_library_env_that_blocks_or_raises_loses_its_episode_only(
    service: ServiceClient, renderer: Renderer, tmp_path: Path
) -> None:
    """A skyrl-gym environment (registered in its own registry) whose step blocks its thread on one
    row and raises on another: those two episodes of 8 fail (the timeout cuts the blocked call,
    which runs in a worker thread), are logged in errors.jsonl, and the step trains on the rest."""
    import threading

    import skyrl_gym
    from skyrl_gym.envs.base_text_env import BaseTextEnv

    from opentinker.rl import RLConfig, run_rl

    release = threading.Event()

    class Faulty(BaseTextEnv):
        def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
            super().__init__()
            self.kind = (extras or {})["extra_info"]["kind"]

        def step(self, action: str) -> Any:
            if self.kind == "block":
                release.wait(60)  # a blocking call that never yields to the event loop
            if self.kind == "raise":
                raise ConnectionError("the sandbox went away")
            return {"observations": [], "reward": float(len(action) % 3), "done": True, "metadata": {}}

    skyrl_gym.register(id="opentinker_test_faulty", entry_point=Faulty)
    kinds = ["ok", "ok", "raise", "ok", "block", "ok", "ok", "ok"]
    rows = [
        {"prompt": [{"role": "user", "content": f"say {i}"}], "extra_info": {"kind": k}}
        for i, k in enumerate(kinds)
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows * 2))  # the first 8 are held out
    cfg = RLConfig(base_model=TEST_MODEL, log_dir=str(tmp_path / "run"), steps=1, groups_per_step=8, group_size=1,
                   lora_rank=4, max_tokens=4, eval_every=0, progress=False, episode_timeout_s=1.0,
                   drop_constant_groups=False, extra={"eval_problems": 8})  # fmt: skip
    try:
        dataset, _ = get_task(f"skyrl_gym:opentinker_test_faulty?data={data}").build()(renderer, cfg)
        (row,) = asyncio.run(run_rl(cfg, service, dataset)).metrics
    finally:
        release.set()
        skyrl_gym.envs.registration.registry.pop("opentinker_test_faulty", None)
    assert row["env/errors"] == 2 and row["env/episodes"] == 6 and row["train/datums"] == 6
    errors = sorted(
        json.loads(x)["error"] for x in (tmp_path / "run" / "errors.jsonl").read_text().splitlines()
    )
    assert errors == [
        "SkyRLEnv episode: ConnectionError: the sandbox went away",
        "SkyRLEnv episode: TimeoutError: the environment's step took longer than 1 s",
    ]
