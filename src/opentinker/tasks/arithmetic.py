"""Single-turn arithmetic: 2-digit addition with an exact-match reward (the fixed task; docs/LIBRARY.md).

User message ``What is A + B? Answer with just the number.`` (A, B uniform in [10, 99]) through the
model's chat template; reward 1 if the first integer in the completion equals A + B, else 0.
Evaluation: 200 fixed held-out problems, greedy; training problems never include them.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Sequence
from typing import Any

from tinker import types

from opentinker.renderers import Message, Renderer
from opentinker.rl.types import Env, EnvGroupBuilder, MessageEnv, Reply, RLDataset

INT = re.compile(r"-?\d+")
EVAL_SEED = 20_261_129


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}? Answer with just the number."


def first_int_reward(text: str, answer: int) -> float:
    m = INT.search(text)
    return 1.0 if m is not None and int(m.group()) == answer else 0.0


def eval_problems(n: int = 200, seed: int = EVAL_SEED) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    out = []
    while len(out) < n:
        p = (rng.randint(10, 99), rng.randint(10, 99))
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


class AdditionEnv(MessageEnv):
    def __init__(self, renderer: Renderer, a: int, b: int) -> None:
        super().__init__(renderer)
        self.a, self.b = a, b

    def initial_messages(self) -> list[Message]:
        return [{"role": "user", "content": question(self.a, self.b)}]

    async def respond(self, reply: Message, ended: bool) -> Reply:
        r = first_int_reward(reply["content"], self.a + self.b)
        return Reply(r, True, metrics={"correct": r})


class AdditionGroup(EnvGroupBuilder):
    def __init__(self, renderer: Renderer, a: int, b: int, size: int) -> None:
        self.renderer, self.a, self.b, self.size = renderer, a, b, size

    async def make_envs(self) -> Sequence[Env]:
        return [AdditionEnv(self.renderer, self.a, self.b) for _ in range(self.size)]

    def tags(self) -> list[str]:
        return ["addition"]


class AdditionDataset(RLDataset):
    def __init__(self, renderer: Renderer, groups_per_step: int, group_size: int, seed: int = 0) -> None:
        self.renderer, self.n, self.size, self.seed = renderer, groups_per_step, group_size, seed
        self.held_out = set(eval_problems())

    def batch(self, step: int) -> list[EnvGroupBuilder]:
        rng = random.Random(f"addition/{self.seed}/{step}")
        out: list[EnvGroupBuilder] = []
        while len(out) < self.n:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            if (a, b) not in self.held_out:
                out.append(self.group(a, b))
        return out

    def group(self, a: int, b: int) -> EnvGroupBuilder:
        """One problem's group (subclasses change the episode, not the problems)."""
        return AdditionGroup(self.renderer, a, b, self.size)


def make_evaluator(renderer: Renderer, n: int = 200, max_tokens: int = 8):
    problems = eval_problems(n)
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=renderer.stop)

    async def evaluate(policy: Any, step: int) -> dict[str, float]:
        async def one(a: int, b: int) -> float:
            prompt = renderer.build_generation_prompt([{"role": "user", "content": question(a, b)}])
            resp = await policy.sample(
                prompt=types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params
            )
            text = renderer.parse_response(list(resp.sequences[0].tokens))[0]["content"]
            return first_int_reward(text, a + b)

        scores = await asyncio.gather(*(one(a, b) for a, b in problems))
        return {"accuracy": sum(scores) / len(scores)}

    return evaluate


def build(renderer: Renderer, cfg: Any) -> tuple[RLDataset, Any]:
    """Registry entry: the training problems and the 200-problem greedy evaluator."""
    return (
        AdditionDataset(renderer, cfg.groups_per_step, cfg.group_size, seed=cfg.seed),
        make_evaluator(renderer, n=int(cfg.extra.get("eval_problems", 200)), max_tokens=cfg.max_tokens),
    )
