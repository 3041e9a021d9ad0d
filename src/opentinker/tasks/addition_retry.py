"""Multi-turn arithmetic with environment feedback: the fixed addition task, with retries.

The opening user message is the addition task's (``What is A + B? Answer with just the number.``);
a reply whose first integer is A + B ends the episode with reward ``1 - retry_cost * (attempt - 1)``;
a wrong reply gets the user turn ``That is not correct. Answer with just the number.`` and another
attempt, up to ``attempts`` (default 3); then the episode ends with reward 0. One episode is one
token sequence (each feedback turn masked, each reply trained), one datum.

Evaluation: one greedy episode per held-out problem (the addition task's 200, or ``eval_problems``):
``success`` (= ``accuracy``: solved within the attempts), ``first_try`` (solved by the first reply)
and the mean number of ``attempts``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tinker import types

from opentinker.renderers import Message, Renderer
from opentinker.rl.rollout import rollout_group
from opentinker.rl.types import Env, EnvGroupBuilder, MessageEnv, Reply, RLDataset
from opentinker.tasks.arithmetic import AdditionDataset, eval_problems, first_int_reward, question

FEEDBACK = "That is not correct. Answer with just the number."


class RetryAdditionEnv(MessageEnv):
    def __init__(self, renderer: Renderer, a: int, b: int, attempts: int, retry_cost: float) -> None:
        super().__init__(renderer)
        self.a, self.b, self.attempts, self.retry_cost = a, b, attempts, retry_cost
        self.tries = 0

    def initial_messages(self) -> list[Message]:
        return [{"role": "user", "content": question(self.a, self.b)}]

    async def respond(self, reply: Message, ended: bool) -> Reply:
        self.tries += 1
        correct = first_int_reward(reply["content"], self.a + self.b)
        if correct or self.tries >= self.attempts:
            reward = (1.0 - self.retry_cost * (self.tries - 1)) if correct else 0.0
            metrics = {
                "success": correct,
                "first_try": float(correct and self.tries == 1),
                "attempts": self.tries,
            }
            return Reply(reward, True, metrics={k: float(v) for k, v in metrics.items()})
        return Reply(0.0, False, [{"role": "user", "content": FEEDBACK}])


class RetryAdditionGroup(EnvGroupBuilder):
    def __init__(
        self, renderer: Renderer, problems: Sequence[tuple[int, int]], attempts: int, retry_cost: float
    ) -> None:
        self.renderer, self.problems, self.attempts, self.retry_cost = (
            renderer,
            problems,
            attempts,
            retry_cost,
        )

    async def make_envs(self) -> Sequence[Env]:
        return [
            RetryAdditionEnv(self.renderer, a, b, self.attempts, self.retry_cost) for a, b in self.problems
        ]

    def tags(self) -> list[str]:
        return ["addition_retry"]


class RetryAdditionDataset(AdditionDataset):
    """The addition task's training problems (never a held-out one), as retry episodes."""

    def __init__(
        self, renderer: Renderer, groups_per_step: int, group_size: int, *, seed: int = 0,
        attempts: int = 3, retry_cost: float = 0.3,
    ) -> None:  # fmt: skip
        super().__init__(renderer, groups_per_step, group_size, seed=seed)
        self.attempts, self.retry_cost = attempts, retry_cost

    def group(self, a: int, b: int) -> EnvGroupBuilder:
        return RetryAdditionGroup(self.renderer, [(a, b)] * self.size, self.attempts, self.retry_cost)


def make_evaluator(renderer: Renderer, n: int = 200, *, attempts: int = 3, max_tokens: int = 8):
    greedy = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    group = RetryAdditionGroup(renderer, eval_problems(n), attempts, retry_cost=0.0)

    async def evaluate(policy: Any, step: int) -> dict[str, float]:
        g = await rollout_group(group, policy, greedy, seed=0)
        last = [t.transitions[-1].metrics for t in g.trajectories]

        def rate(key: str) -> float:
            return sum(m.get(key, 0.0) for m in last) / max(1, len(last))

        return {
            "accuracy": rate("success"),
            "success": rate("success"),
            "first_try": rate("first_try"),
            "attempts": rate("attempts"),
            "errors": float(g.errors),
        }

    return evaluate


def build(renderer: Renderer, cfg: Any) -> tuple[RLDataset, Any]:
    """Registry entry. ``cfg.extra``: ``attempts`` (3), ``retry_cost`` (0.3), ``eval_problems`` (200)."""
    extra = getattr(cfg, "extra", None) or {}
    attempts = int(extra.get("attempts", 3))
    dataset = RetryAdditionDataset(
        renderer, cfg.groups_per_step, cfg.group_size, seed=cfg.seed,
        attempts=attempts, retry_cost=float(extra.get("retry_cost", 0.3)),
    )  # fmt: skip
    n = int(extra.get("eval_problems", 200))
    return dataset, make_evaluator(renderer, n, attempts=attempts, max_tokens=cfg.max_tokens)
