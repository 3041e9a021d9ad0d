"""A failing sampler stops an RL run with a clear error; a failing environment is counted and the
run goes on. The two used to be one: every sample request that raised was counted as an
environment error, so a dead sampler left a run training on nothing, step after step."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from tinker import types

from opentinker.client import ServiceClient
from opentinker.renderers import ChatMLRenderer, Renderer
from opentinker.rl import (
    Env,
    EnvGroupBuilder,
    RLConfig,
    RLDataset,
    SamplerError,
    StepResult,
    rollout_group,
    run_rl,
)
from opentinker.rl.multiagent import play_group
from opentinker.rl.types import GameGroupBuilder, MultiAgentEnv
from opentinker.service.runtime import Runtime
from tests.conftest import TEST_MODEL


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> ServiceClient:
    return ServiceClient(runtime=Runtime(tmp_path_factory.mktemp("rl-sampler"), max_rank=16))


@pytest.fixture(scope="module")
def renderer(service: ServiceClient) -> ChatMLRenderer:
    return ChatMLRenderer(service.runtime.base_stack(TEST_MODEL).engine.base.tokenizer)


class OneTurn(Env):
    def __init__(self, renderer: Renderer, fail: str = "") -> None:
        self.renderer, self.fail, self.stop = renderer, fail, renderer.stop

    async def initial_observation(self) -> list[int]:
        if self.fail == "too_long":
            return [5] * 1100  # longer than the tiny model's 1024-token context: the sampler refuses it
        return self.renderer.build_generation_prompt([{"role": "user", "content": f"Say hi {self.fail}"}])

    async def step(self, action: list[int]) -> StepResult:
        if self.fail == "step":
            raise RuntimeError("boom at step")
        if self.fail == "hang":  # never answers: only the episode timeout ends it
            await asyncio.Event().wait()
        if self.fail == "malformed":  # text where the next observation's token ids belong
            return StepResult(0.0, False, next_ob_T="the board is empty")  # type: ignore[arg-type]
        return StepResult(sum(action) % 101 / 100, True)


class Group(EnvGroupBuilder):
    def __init__(self, renderer: Renderer, fails: list[str]) -> None:
        self.renderer, self.fails = renderer, fails

    async def make_envs(self) -> Sequence[Env]:
        return [OneTurn(self.renderer, f) for f in self.fails]


class Dataset(RLDataset):
    def __init__(self, renderer: Renderer, fails: list[str]) -> None:
        self.renderer, self.fails = renderer, fails

    def batch(self, step: int) -> list[EnvGroupBuilder]:
        return [Group(self.renderer, self.fails)]


class DeadSampler:
    """A sampling client whose every request fails (its worker died, the server went away)."""

    async def sample(self, **_: Any) -> Any:
        raise ConnectionError("sampler worker 0 is gone")


class SamplerDiesAfter:
    """A training client whose sampling clients are dead from its ``alive``-th weight save on (the
    first save is the run's starting policy)."""

    def __init__(self, tc: Any, alive: int) -> None:
        self.tc, self.alive, self.saves = tc, alive, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tc, name)

    async def save_weights_and_get_sampling_client(self, *a: Any, **kw: Any) -> Any:
        self.saves += 1
        policy = await self.tc.save_weights_and_get_sampling_client(*a, **kw)
        return policy if self.saves <= self.alive else DeadSampler()


def _cfg(tmp_path: Path, name: str, **kw: Any) -> RLConfig:
    base: dict[str, Any] = dict(
        base_model=TEST_MODEL, log_dir=str(tmp_path / name), steps=4, groups_per_step=1, group_size=4,
        lora_rank=4, learning_rate=1e-3, max_tokens=6, progress=False, drop_constant_groups=False,
    )  # fmt: skip
    base.update(kw)
    return RLConfig(**base)


def _rows(log_dir: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (Path(log_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_rollout_counts_environment_errors_and_raises_on_a_dead_sampler(
    service: ServiceClient, renderer: Renderer
) -> None:
    params = types.SamplingParams(max_tokens=4, temperature=1.0)
    policy = service.create_sampling_client(base_model=TEST_MODEL)
    g = asyncio.run(rollout_group(Group(renderer, ["", "", "step", "too_long"]), policy, params, seed=0))
    assert g.errors == 2 and len(g.trajectories) == 2  # the environment's failures: counted
    with pytest.raises(SamplerError, match="the sampler failed: ConnectionError: sampler worker 0 is gone"):
        asyncio.run(rollout_group(Group(renderer, ["", "", "step"]), DeadSampler(), params, seed=0))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_sampler_that_dies_stops_the_run(
    service: ServiceClient, renderer: Renderer, tmp_path: Path, mode: str
) -> None:
    """The run trains while the sampler works, then raises a SamplerError naming the failure; no
    step is logged (or trained) on the empty rollouts of a dead sampler."""
    cfg = _cfg(tmp_path, mode, mode=mode)
    tc = SamplerDiesAfter(service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=0), alive=2)
    with pytest.raises(SamplerError, match="sampler worker 0 is gone"):
        asyncio.run(
            asyncio.wait_for(
                run_rl(cfg, service, Dataset(renderer, ["", "", "", "step"]), training_client=tc), 120
            )
        )
    rows = _rows(cfg.log_dir)
    # sync: step s samples from save s + 1: steps 0 and 1 live, step 2 dead. async (staleness 1):
    # step s samples from save s (step 0 too, from the start): steps 0-2 live, step 3 dead
    assert [r["step"] for r in rows] == ([0, 1] if mode == "sync" else [0, 1, 2])
    assert all(r["env/errors"] == 1 and r["env/episodes"] == 3 and r["train/datums"] == 3 for r in rows)


def test_a_shut_down_runtime_stops_the_run(renderer: Renderer, tmp_path: Path) -> None:
    """The real thing: the embedded runtime is shut down after step 0; the next step's sample
    requests fail and the run stops, naming the sampler's failure."""
    service = ServiceClient(runtime=Runtime(tmp_path / "data", max_rank=16))
    cfg = _cfg(tmp_path, "shutdown")

    def after_step(name: str, row: dict[str, Any]) -> None:
        service.runtime.shutdown()

    with pytest.raises(SamplerError, match="the sampler failed: RuntimeError: the scheduler is shut down"):
        asyncio.run(run_rl(cfg, service, Dataset(renderer, ["", "", ""]), on_step=after_step))
    assert [r["step"] for r in _rows(cfg.log_dir)] == [0]


class Echo(MultiAgentEnv):
    """A one-move game for agent A."""

    agents = ("A",)

    def __init__(self, renderer: Renderer) -> None:
        super().__init__(renderer)
        self.moved = False

    def current_agent(self) -> str | None:
        return None if self.moved else "A"

    def observe(self, agent: str) -> list[Any]:
        return [{"role": "user", "content": "Say hi"}]

    async def act(self, agent: str, reply: Any, ended: bool) -> dict[str, float]:
        self.moved = True
        return {}

    def rewards(self) -> dict[str, float]:
        return {"A": 1.0}


class Games(GameGroupBuilder):
    def __init__(self, renderer: Renderer) -> None:
        self.renderer = renderer

    async def make_games(self) -> Sequence[MultiAgentEnv]:
        return [Echo(self.renderer) for _ in range(3)]


def test_multiagent_games_raise_on_a_dead_sampler(service: ServiceClient, renderer: Renderer) -> None:
    params = types.SamplingParams(max_tokens=4, temperature=1.0)
    live = service.create_sampling_client(base_model=TEST_MODEL)
    g = asyncio.run(play_group(Games(renderer), {"A": live}, params, seed=0))
    assert g.errors == 0 and len(g.games) == 3
    with pytest.raises(SamplerError, match="sampler worker 0 is gone"):
        asyncio.run(play_group(Games(renderer), {"A": DeadSampler()}, params, seed=0))


def test_one_episode_in_eight_raises_one_hangs_the_run_trains_on(
    service: ServiceClient, renderer: Renderer, tmp_path: Path
) -> None:
    """Of 8 episodes per step, one raises and one hangs past the episode timeout: each step trains
    on the other 6, counts 2 errors, and writes both errors (what raised, the timeout) to
    errors.jsonl; a malformed observation (text, not token ids) is a third kind, logged the same."""
    fails = ["", "", "", "step", "", "hang", "", ""]
    cfg = _cfg(tmp_path, "faults", steps=3, group_size=8, episode_timeout_s=1.0)
    res = asyncio.run(run_rl(cfg, service, Dataset(renderer, fails)))
    assert [r["step"] for r in res.metrics] == [0, 1, 2]
    for row in res.metrics:
        assert row["env/errors"] == 2 and row["env/episodes"] == 6 and row["train/datums"] == 6
    errors = [json.loads(x) for x in (Path(cfg.log_dir) / "errors.jsonl").read_text().splitlines()]
    assert [e["step"] for e in errors] == [0, 0, 1, 1, 2, 2]
    for step in range(3):
        got = sorted(e["error"] for e in errors if e["step"] == step)
        assert got == [
            "OneTurn episode: RuntimeError: boom at step",
            "OneTurn episode: TimeoutError: the environment's step took longer than 1 s",
        ]

    cfg = _cfg(tmp_path, "malformed", steps=1, group_size=4)
    (row,) = asyncio.run(run_rl(cfg, service, Dataset(renderer, ["", "", "", "malformed"]))).metrics
    assert row["env/errors"] == 1 and row["env/episodes"] == 3
    (e,) = [json.loads(x) for x in (Path(cfg.log_dir) / "errors.jsonl").read_text().splitlines()]
    assert "next observation is not a list of token ids (got str)" in e["error"]
