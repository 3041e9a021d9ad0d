"""Multi-turn: guess a secret number in 1..100 with "Higher." / "Lower." feedback.

The chat is the one ``opentinker/tiny`` was pretrained on: user ``I'm thinking of a number between
1 and 100. Guess it.``, assistant ``Is it N?``, user ``Higher.`` / ``Lower.`` / ``Correct!``. The
first integer of each assistant reply is its guess. An episode ends when the guess is right, after
``max_turns`` guesses, or at a reply without an integer.

Reward (at the end only): ``1 - shaping * (turns - 1)`` when guessed (``shaping = 0.1`` rewards fewer
guesses; binary search needs at most 7), else 0. Metrics of the last turn: ``success``, ``turns``,
``invalid`` (the episode ended at a reply without an integer).

Training groups: ``group_size`` episodes sharing one secret (so advantages compare strategies on the
same number). Secrets are uniform over 1..100 minus the held-out ones the evaluator uses (greedy
play, one episode per held-out secret: ``success``, ``turns``; ``accuracy`` = ``success`` so the
default plots and progress bar show it).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from tinker import types

from opentinker.renderers import Message, Renderer
from opentinker.rl.env import Env, EnvGroupBuilder, MessageEnv, Reply, RLDataset
from opentinker.rl.rollout import rollout_group

PROMPT = "I'm thinking of a number between 1 and 100. Guess it."
INT = re.compile(r"-?\d+")
LOW, HIGH = 1, 100
EVAL_SEED = 20_261_130


def parse_guess(text: str) -> int | None:
    m = INT.search(text)
    return int(m.group()) if m is not None else None


def held_out_secrets(n: int = 25, seed: int = EVAL_SEED) -> list[int]:
    """The evaluator's secrets (never drawn for training)."""
    return sorted(random.Random(seed).sample(range(LOW, HIGH + 1), n))


class GuessNumberEnv(MessageEnv):
    def __init__(self, renderer: Renderer, secret: int, max_turns: int = 7, shaping: float = 0.1) -> None:
        super().__init__(renderer)
        if not LOW <= secret <= HIGH:
            raise ValueError(f"secret must be in {LOW}..{HIGH}, got {secret}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.secret, self.max_turns, self.shaping = secret, max_turns, shaping
        self.turns = 0

    def initial_messages(self) -> list[Message]:
        self.turns = 0
        return [{"role": "user", "content": PROMPT}]

    def _end(self, success: bool, invalid: bool = False) -> Reply:
        reward = max(0.0, 1.0 - self.shaping * (self.turns - 1)) if success else 0.0
        metrics = {"success": float(success), "turns": float(self.turns), "invalid": float(invalid)}
        return Reply(reward, True, metrics=metrics)

    async def respond(self, reply: Message, ended: bool) -> Reply:
        self.turns += 1
        guess = parse_guess(reply["content"])
        if guess is None:
            return self._end(False, invalid=True)
        if guess == self.secret:
            return self._end(True)
        if self.turns >= self.max_turns:
            return self._end(False)
        hint = "Higher." if guess < self.secret else "Lower."
        return Reply(0.0, False, [{"role": "user", "content": hint}])


class GuessNumberGroup(EnvGroupBuilder):
    """``size`` episodes on one secret."""

    def __init__(self, renderer: Renderer, secrets: Sequence[int], max_turns: int, shaping: float) -> None:
        self.renderer, self.secrets, self.max_turns, self.shaping = (
            renderer,
            list(secrets),
            max_turns,
            shaping,
        )

    async def make_envs(self) -> Sequence[Env]:
        return [GuessNumberEnv(self.renderer, s, self.max_turns, self.shaping) for s in self.secrets]

    def tags(self) -> list[str]:
        return ["guess_number"]


class GuessNumberDataset(RLDataset):
    def __init__(
        self,
        renderer: Renderer,
        groups_per_step: int,
        group_size: int,
        *,
        seed: int = 0,
        max_turns: int = 7,
        shaping: float = 0.1,
        held_out: Sequence[int] = (),
    ) -> None:
        self.renderer, self.n, self.size, self.seed = renderer, groups_per_step, group_size, seed
        self.max_turns, self.shaping = max_turns, shaping
        self.secrets = [s for s in range(LOW, HIGH + 1) if s not in set(held_out)]

    def batch(self, step: int) -> list[EnvGroupBuilder]:
        rng = random.Random(f"guess_number/{self.seed}/{step}")
        return [
            GuessNumberGroup(
                self.renderer, [rng.choice(self.secrets)] * self.size, self.max_turns, self.shaping
            )
            for _ in range(self.n)
        ]


def make_evaluator(renderer: Renderer, secrets: Sequence[int], *, max_turns: int = 7, max_tokens: int = 12):
    """Greedy play, one episode per secret: success rate, mean guesses (all episodes), invalid rate."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    group = GuessNumberGroup(renderer, secrets, max_turns, shaping=0.0)

    async def evaluate(policy: Any, step: int) -> dict[str, float]:
        g = await rollout_group(group, policy, params, seed=0)
        last = [t.transitions[-1].metrics for t in g.trajectories]
        n = max(1, len(last))
        success = sum(m["success"] for m in last) / n
        return {
            "accuracy": success,
            "success": success,
            "turns": sum(m["turns"] for m in last) / n,
            "invalid": sum(m["invalid"] for m in last) / n,
            "errors": float(g.errors),
        }

    return evaluate


def build(renderer: Renderer, cfg: Any) -> tuple[RLDataset, Any]:
    """Registry entry. ``cfg.extra``: ``max_turns`` (7), ``shaping`` (0.1), ``eval_secrets`` (25)."""
    extra = getattr(cfg, "extra", None) or {}
    max_turns = int(extra.get("max_turns", 7))
    shaping = float(extra.get("shaping", 0.1))
    held = held_out_secrets(int(extra.get("eval_secrets", 25)))
    dataset = GuessNumberDataset(
        renderer, cfg.groups_per_step, cfg.group_size,
        seed=cfg.seed, max_turns=max_turns, shaping=shaping, held_out=held,
    )  # fmt: skip
    return dataset, make_evaluator(renderer, held, max_turns=max_turns, max_tokens=cfg.max_tokens)
