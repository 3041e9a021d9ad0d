"""Multi-turn tool use: multiplication with a calculator that the environment runs.

The user asks ``What is A * B? You can use a calculator: write CALC A * B and you will get the
result. Then answer with just the number.`` (A uniform in [100, 999], B in [10, 99]: products a
135M-parameter model does not compute by itself, so success comes through the tool's reply).

Each assistant reply is read in this order:

1. its first number (``56,876`` and ``56876`` alike) is A·B → solved: reward 1, the episode ends;
2. it contains an arithmetic expression ``X op Y`` (``op`` one of ``+ - * x ×``, with or without
   the word CALC) → a calculator call: the environment evaluates the *first* such expression —
   whatever numbers the model wrote — and answers ``CALC X op Y = V. Now answer with just the
   number.``;
3. otherwise the user turn ``That is not the answer. Write CALC followed by the expression to use
   the calculator, or answer with just the number.``

After ``turns`` replies (default 3) without the answer the episode ends with reward 0. Metrics of
the last turn: ``success``, ``turns``, ``calls`` (calculator calls in the episode) and ``right_call``
(some call was exactly A * B).

Evaluation: one greedy episode per held-out problem (``eval_problems``, default 100; never drawn
for training): ``success`` (= ``accuracy``), ``calls``, ``right_call``, ``turns``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from tinker import types

from opentinker.renderers import Message, Renderer
from opentinker.rl.rollout import rollout_group
from opentinker.rl.types import Env, EnvGroupBuilder, MessageEnv, Reply, RLDataset

NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?!\d)|-?\d+")
EXPR = re.compile(r"(-?\d+)\s*([-+*x×])\s*(-?\d+)")
EVAL_SEED = 20_261_130
NUDGE = "That is not the answer. Write CALC followed by the expression to use the calculator, or answer with just the number."


def question(a: int, b: int) -> str:
    return (
        f"What is {a} * {b}? You can use a calculator: write CALC {a} * {b} and you will get the "
        "result. Then answer with just the number."
    )


def first_number(text: str) -> int | None:
    """The first integer in ``text``; thousands separators (``56,876``) are part of it."""
    m = NUMBER.search(text)
    return int(m.group().replace(",", "")) if m is not None else None


def calculator_call(text: str) -> tuple[int, str, int, int] | None:
    """The first ``X op Y`` in ``text`` and its value, or None."""
    m = EXPR.search(text)
    if m is None:
        return None
    x, op, y = int(m.group(1)), m.group(2), int(m.group(3))
    value = x + y if op == "+" else x - y if op == "-" else x * y
    return x, "*" if op in "x×" else op, y, value


def eval_problems(n: int = 100, seed: int = EVAL_SEED) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    out: list[tuple[int, int]] = []
    while len(out) < n:
        p = (rng.randint(100, 999), rng.randint(10, 99))
        if p not in out:
            out.append(p)
    return out


class CalculatorEnv(MessageEnv):
    def __init__(self, renderer: Renderer, a: int, b: int, turns: int = 3) -> None:
        super().__init__(renderer)
        self.a, self.b, self.turns = a, b, turns
        self.replies = self.calls = 0
        self.right_call = False

    def initial_messages(self) -> list[Message]:
        return [{"role": "user", "content": question(self.a, self.b)}]

    async def respond(self, reply: Message, ended: bool) -> Reply:
        self.replies += 1
        text = reply["content"]
        solved = first_number(text) == self.a * self.b
        call = None if solved else calculator_call(text)
        if call is not None:
            self.calls += 1
            self.right_call |= call[:3] == (self.a, "*", self.b)
        if solved or self.replies >= self.turns:
            metrics = {
                "success": float(solved),
                "turns": float(self.replies),
                "calls": float(self.calls),
                "right_call": float(self.right_call),
            }
            return Reply(1.0 if solved else 0.0, True, metrics=metrics)
        if call is not None:
            x, op, y, value = call
            answer = f"CALC {x} {op} {y} = {value}. Now answer with just the number."
            return Reply(0.0, False, [{"role": "user", "content": answer}])
        return Reply(0.0, False, [{"role": "user", "content": NUDGE}])


class CalculatorGroup(EnvGroupBuilder):
    def __init__(self, renderer: Renderer, problems: Sequence[tuple[int, int]], turns: int) -> None:
        self.renderer, self.problems, self.turns = renderer, problems, turns

    async def make_envs(self) -> Sequence[Env]:
        return [CalculatorEnv(self.renderer, a, b, self.turns) for a, b in self.problems]

    def tags(self) -> list[str]:
        return ["calculator"]


class CalculatorDataset(RLDataset):
    """``groups_per_step`` problems per step, ``group_size`` episodes of each (never a held-out one)."""

    def __init__(
        self, renderer: Renderer, groups_per_step: int, group_size: int, *, seed: int = 0, turns: int = 3
    ) -> None:
        self.renderer, self.n, self.size, self.seed, self.turns = (
            renderer,
            groups_per_step,
            group_size,
            seed,
            turns,
        )
        self.held_out = set(eval_problems())

    def batch(self, step: int) -> list[EnvGroupBuilder]:
        rng = random.Random(f"calculator/{self.seed}/{step}")
        out: list[EnvGroupBuilder] = []
        while len(out) < self.n:
            a, b = rng.randint(100, 999), rng.randint(10, 99)
            if (a, b) not in self.held_out:
                out.append(CalculatorGroup(self.renderer, [(a, b)] * self.size, self.turns))
        return out


def make_evaluator(renderer: Renderer, n: int = 100, *, turns: int = 3, max_tokens: int = 16):
    greedy = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    group = CalculatorGroup(renderer, eval_problems(n), turns)

    async def evaluate(policy: Any, step: int) -> dict[str, float]:
        g = await rollout_group(group, policy, greedy, seed=0)
        last = [t.transitions[-1].metrics for t in g.trajectories]

        def mean(key: str) -> float:
            return sum(m.get(key, 0.0) for m in last) / max(1, len(last))

        keys = ("success", "calls", "right_call", "turns")
        return {"accuracy": mean("success"), **{k: mean(k) for k in keys}, "errors": float(g.errors)}

    return evaluate


def build(renderer: Renderer, cfg: Any) -> tuple[RLDataset, Any]:
    """Registry entry. ``cfg.extra``: ``turns`` (3), ``eval_problems`` (100)."""
    extra = getattr(cfg, "extra", None) or {}
    turns = int(extra.get("turns", 3))
    dataset = CalculatorDataset(renderer, cfg.groups_per_step, cfg.group_size, seed=cfg.seed, turns=turns)
    n = int(extra.get("eval_problems", 100))
    return dataset, make_evaluator(renderer, n, turns=turns, max_tokens=cfg.max_tokens)
