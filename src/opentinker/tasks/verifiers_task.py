"""A verifiers ``Environment`` as a task: ``verifiers:<env_id>[?arg=value&...]`` (the environment
module's ``load_environment(**args)``, as ``verifiers.load_environment`` finds it), or any
``MultiTurnEnv`` object (``SingleTurnEnv`` included) through :func:`environment_task`.

The episode runs the environment's own turn machinery, with our sampler in place of its OpenAI
client: ``init_state`` + ``setup_state`` on a dataset row, ``get_prompt_messages`` for each turn's
prompt (which calls its ``env_response`` after the first), ``add_trajectory_step`` with the sampled
reply, its stop conditions (``is_completed``) to end the episode, ``render_completion``, and its
rubric's ``score_rollout`` as the reward (the weighted sum of its reward functions; each one is
logged as ``env/<function>``). Group-level reward functions need the whole group at once, which
this per-episode reward does not give: such a rubric is refused.

Evaluation: ``eval_problems`` (default 50) rows of its eval dataset (its train dataset when it has
none), greedy; ``eval/reward`` is the mean reward, ``eval/accuracy`` the share with reward >= 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Sequence
from typing import Any

import verifiers as vf
from tinker import types

from opentinker.renderers import Message, Renderer
from opentinker.rl.types import Env, EnvGroupBuilder, RLDataset, StepResult

MODEL = "opentinker-policy"  # the model name the environment's state records (never called)


def _message(m: Any) -> Message:
    content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
    role = m.get("role") if isinstance(m, dict) else getattr(m, "role", None)
    if not isinstance(content, str):  # multimodal parts: their text, in order
        parts = content or []
        content = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
    return {"role": str(role), "content": content}


def check_environment(env: Any) -> None:
    """Refuse what this adapter cannot run, naming it."""
    if not isinstance(env, vf.MultiTurnEnv):
        raise ValueError(
            f"verifiers environment {type(env).__name__} is not a MultiTurnEnv (SingleTurnEnv, ToolEnv, ...)"
        )
    if env.message_type != "chat":
        raise ValueError(f"verifiers environment {type(env).__name__}: only chat environments are supported")
    if env.rubric._get_group_reward_funcs():
        raise ValueError(
            f"verifiers environment {type(env).__name__}: its rubric has group-level reward functions"
            " (the reward here is per episode)"
        )


class VerifiersEnv(Env):
    """One rollout of a verifiers ``MultiTurnEnv`` on one dataset row."""

    def __init__(self, env: Any, row: dict[str, Any], renderer: Renderer) -> None:
        self.env, self.row, self.renderer = env, row, renderer
        self.stop = renderer.stop
        self.state: Any = None
        self.prompt: list[Any] = []  # this turn's prompt, in the environment's messages
        self.ob_T: list[int] = []

    async def initial_observation(self) -> list[int]:
        self.state = await self.env.init_state(dict(self.row), client=None, model=MODEL)
        self.state = await self.env.setup_state(self.state)
        self.prompt = list(await self.env.get_prompt_messages(self.state))
        self.ob_T = self.renderer.build_generation_prompt([_message(m) for m in self.prompt])
        return self.ob_T

    async def step(self, action: list[int]) -> StepResult:
        reply, ended = self.renderer.parse_response(action)
        step = vf.TrajectoryStep(
            prompt=self.prompt, completion=[{"role": "assistant", "content": reply["content"]}],
            response=None, tokens=None, reward=None, advantage=None, is_truncated=not ended,
            trajectory_id=self.state["trajectory_id"], extras={},
        )  # type: ignore[typeddict-item]  # fmt: skip
        await self.env.add_trajectory_step(self.state, step)
        if not await self.env.is_completed(self.state):
            prompt = list(await self.env.get_prompt_messages(self.state))
            # the environment ended the rollout in its reply (final_env_response): is_completed says so
            if not await self.env.is_completed(self.state):
                new = [_message(m) for m in prompt[len(self.prompt) + 1 :]]
                if not new:
                    raise ValueError("verifiers environment answered with no message")
                self.ob_T = self.ob_T + list(action) + self.renderer.next_turn_tokens(ended, new)
                self.prompt = prompt
                return StepResult(0.0, False, self.ob_T)
        return await self.score()

    async def score(self) -> StepResult:
        if self.state.get("error") is not None:
            raise RuntimeError(f"verifiers rollout failed: {self.state['error']!r}")
        await self.env.render_completion(self.state)
        await self.env.rubric.score_rollout(self.state, score_sem=contextlib.nullcontext())
        metrics = {k: float(v) for k, v in (self.state.get("metrics") or {}).items()}
        return StepResult(float(self.state["reward"]), True, metrics=metrics)


class VerifiersGroup(EnvGroupBuilder):
    def __init__(self, env: Any, row: dict[str, Any], renderer: Renderer, size: int, tag: str) -> None:
        self.env, self.row, self.renderer, self.size, self.tag = env, row, renderer, size, tag

    async def make_envs(self) -> Sequence[Env]:
        return [VerifiersEnv(self.env, self.row, self.renderer) for _ in range(self.size)]

    def tags(self) -> list[str]:
        return [self.tag]


class VerifiersDataset(RLDataset):
    """Step ``s`` takes the next ``groups_per_step`` rows of the environment's dataset, in an order
    fixed by ``seed`` (wrapping around)."""

    def __init__(
        self, env: Any, renderer: Renderer, groups_per_step: int, group_size: int, seed: int
    ) -> None:
        self.env, self.renderer, self.n, self.size = env, renderer, groups_per_step, group_size
        self.rows = [dict(r) for r in env.get_dataset()]
        if not self.rows:
            raise ValueError("verifiers environment has an empty dataset")
        self.order = list(range(len(self.rows)))
        random.Random(f"verifiers/{seed}").shuffle(self.order)
        self.tag = env.env_id or type(env).__name__

    def batch(self, step: int) -> list[EnvGroupBuilder]:
        at = step * self.n
        rows = [self.rows[self.order[(at + k) % len(self.order)]] for k in range(self.n)]
        return [VerifiersGroup(self.env, r, self.renderer, self.size, self.tag) for r in rows]


async def play(
    env: Any, row: dict[str, Any], renderer: Renderer, policy: Any, params: types.SamplingParams
) -> float:
    """One rollout sampled from ``policy`` (the evaluator's; training goes through rl.rollout)."""
    e = VerifiersEnv(env, row, renderer)
    ob = await e.initial_observation()
    while True:
        resp = await policy.sample(
            prompt=types.ModelInput.from_ints(ob), num_samples=1, sampling_params=params
        )
        res = await e.step(list(resp.sequences[0].tokens))
        if res.done:
            return res.reward
        ob = res.next_ob_T


def make_evaluator(env: Any, renderer: Renderer, n: int, max_tokens: int):
    rows = [dict(r) for r in env.get_eval_dataset(n=n)]
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=renderer.stop)

    async def evaluate(policy: Any, step: int) -> dict[str, float]:
        rewards = await asyncio.gather(*(play(env, r, renderer, policy, params) for r in rows))
        return {
            "reward": sum(rewards) / len(rewards),
            "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
        }

    return evaluate


def environment_task(env: Any, renderer: Renderer, cfg: Any) -> tuple[RLDataset, Any]:
    """A verifiers environment object's training rows and evaluator, for :func:`opentinker.rl.run_rl`."""
    check_environment(env)
    n = int(cfg.extra.get("eval_problems", 50))
    if n < 1:
        raise ValueError(f"eval_problems must be >= 1, got {n}")
    dataset = VerifiersDataset(env, renderer, cfg.groups_per_step, cfg.group_size, cfg.seed)
    return dataset, make_evaluator(env, renderer, n, cfg.max_tokens)


def build(
    renderer: Renderer, cfg: Any, *, environment: str, options: dict[str, Any]
) -> tuple[RLDataset, Any]:
    """Registry entry (``verifiers:<env_id>?<args>``): ``verifiers.load_environment(env_id, **args)``."""
    try:
        env = vf.load_environment(environment, **options)
    except (ImportError, AttributeError, ValueError) as e:  # verifiers says ValueError for a missing module
        raise ValueError(f"verifiers cannot load environment {environment!r}: {e}") from None
    except TypeError as e:
        raise ValueError(f"verifiers environment {environment!r}: bad arguments {options}: {e}") from None
    return environment_task(env, renderer, cfg)
