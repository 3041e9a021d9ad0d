"""Long-horizon guess-the-number: a wide range, up to ``max_turns`` guesses (12), informative feedback.

The chat of :mod:`opentinker.tasks.guess_number` with a wider range: user ``I'm thinking of a
number between 1 and {high}. Guess it.``, assistant ``Is it N?``, user ``Higher.`` / ``Lower.``
(``informative=True`` adds what the feedback so far allows: ``Higher. It is between 51 and
100.``) / ``Correct!``. An episode ends on the right guess, after ``max_turns`` guesses or at a
reply without an integer. Binary search needs ``ceil(log2(high + 1))`` guesses (10 for 1..1000),
so episodes run long, and a small model drifts: it repeats guesses the feedback has already ruled
out. Reward (at the end): 1 when guessed, else 0. Metrics of the last turn: ``success``,
``turns``, ``invalid``; of every guess: ``in_range`` (inside the interval the feedback so far
allows), ``repeat`` (a number it guessed before in this episode), ``bisect``.

Held-out episodes: secrets drawn with a fixed seed from the whole range, minus none (training
secrets come from another seed's stream); :func:`held_out_secrets` gives them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from opentinker.renderers import Message, Renderer
from opentinker.rl.types import Env, EnvGroupBuilder, MessageEnv, Reply, RLDataset
from opentinker.tasks.guess_number import parse_guess

EVAL_SEED = 20_261_202


def prompt(high: int) -> str:
    return f"I'm thinking of a number between 1 and {high}. Guess it."


def held_out_secrets(n: int, high: int, seed: int = EVAL_SEED) -> list[int]:
    """``n`` held-out secrets in 1..``high`` (fixed seed; repeats allowed when n > high)."""
    rng = random.Random(f"guess_number_long/held_out/{seed}/{high}")
    return [rng.randint(1, high) for _ in range(n)]


class LongGuessEnv(MessageEnv):
    def __init__(
        self,
        renderer: Renderer,
        secret: int,
        *,
        high: int = 1000,
        max_turns: int = 12,
        informative: bool = False,
    ) -> None:
        super().__init__(renderer)
        if high < 2:
            raise ValueError(f"high must be >= 2, got {high}")
        if not 1 <= secret <= high:
            raise ValueError(f"secret must be in 1..{high}, got {secret}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.secret, self.high, self.max_turns, self.informative = secret, high, max_turns, informative
        self.turns = 0
        self.lo, self.hi = 1, high
        self.guessed: set[int] = set()

    def initial_messages(self) -> list[Message]:
        self.turns, self.lo, self.hi, self.guessed = 0, 1, self.high, set()
        return [{"role": "user", "content": prompt(self.high)}]

    def _end(self, success: bool, move: dict[str, float], invalid: bool = False) -> Reply:
        metrics = {"success": float(success), "turns": float(self.turns), "invalid": float(invalid)}
        return Reply(float(success), True, metrics={**move, **metrics})

    async def respond(self, reply: Message, ended: bool) -> Reply:
        self.turns += 1
        guess = parse_guess(reply["content"])
        if guess is None:
            return self._end(False, {"in_range": 0.0, "repeat": 0.0, "bisect": 0.0}, invalid=True)
        move = {
            "in_range": float(self.lo <= guess <= self.hi),
            "repeat": float(guess in self.guessed),
            "bisect": float(guess in ((self.lo + self.hi) // 2, (self.lo + self.hi + 1) // 2)),
        }
        self.guessed.add(guess)
        if guess == self.secret:
            return self._end(True, move)
        if guess < self.secret:
            self.lo = max(self.lo, guess + 1)
        else:
            self.hi = min(self.hi, guess - 1)
        if self.turns >= self.max_turns:
            return self._end(False, move)
        hint = "Higher." if guess < self.secret else "Lower."
        if self.informative:
            hint += f" It is between {self.lo} and {self.hi}."
        return Reply(0.0, False, [{"role": "user", "content": hint}], metrics=move)


class LongGuessGroup(EnvGroupBuilder):
    """One episode per entry of ``secrets``."""

    def __init__(self, renderer: Renderer, secrets: Sequence[int], **env_kw: Any) -> None:
        self.renderer, self.secrets, self.env_kw = renderer, list(secrets), env_kw

    async def make_envs(self) -> Sequence[Env]:
        return [LongGuessEnv(self.renderer, s, **self.env_kw) for s in self.secrets]

    def tags(self) -> list[str]:
        return ["guess_number_long"]


class LongGuessDataset(RLDataset):
    """``groups_per_step`` groups of ``group_size`` episodes on one secret each."""

    def __init__(
        self, renderer: Renderer, groups_per_step: int, group_size: int, *, seed: int = 0, **env_kw: Any
    ) -> None:
        self.renderer, self.n, self.size, self.seed, self.env_kw = (
            renderer,
            groups_per_step,
            group_size,
            seed,
            env_kw,
        )

    def batch(self, step: int) -> list[EnvGroupBuilder]:
        rng = random.Random(f"guess_number_long/{self.seed}/{step}")
        high = int(self.env_kw.get("high", 1000))
        return [
            LongGuessGroup(self.renderer, [rng.randint(1, high)] * self.size, **self.env_kw)
            for _ in range(self.n)
        ]


def last_metrics(groups: Sequence[Any], key: str) -> float:
    vals = [t.transitions[-1].metrics[key] for g in groups for t in g.trajectories]
    return sum(vals) / max(1, len(vals))


def per_guess(groups: Sequence[Any], key: str) -> float:
    vals = [
        tr.metrics[key] for g in groups for t in g.trajectories for tr in t.transitions if key in tr.metrics
    ]
    return sum(vals) / max(1, len(vals))


def build(renderer: Renderer, cfg: Any) -> tuple[RLDataset, Any]:
    """Registry entry. ``cfg.extra``: ``high`` (1000), ``max_turns`` (12), ``informative`` (False)."""
    extra = getattr(cfg, "extra", None) or {}
    kw = {
        "high": int(extra.get("high", 1000)),
        "max_turns": int(extra.get("max_turns", 12)),
        "informative": bool(extra.get("informative", False)),
    }
    return LongGuessDataset(renderer, cfg.groups_per_step, cfg.group_size, seed=cfg.seed, **kw), None
