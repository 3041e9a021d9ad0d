"""Multi-turn: guess a secret number in 1..100 with "Higher." / "Lower." feedback.

The chat is the one ``opentinker/tiny`` was pretrained on: user ``I'm thinking of a number between
1 and 100. Guess it.``, assistant ``Is it N?``, user ``Higher.`` / ``Lower.`` / ``Correct!``. The
first integer of each assistant reply is its guess. An episode ends when the guess is right, after
``max_turns`` guesses, or at a reply without an integer.

Reward (at the end only): ``1 - shaping * (turns - 1)`` when guessed (``shaping = 0.1`` rewards fewer
guesses; binary search needs at most 7), else 0. Metrics of the last turn: ``success``, ``turns``,
``invalid`` (the episode ended at a reply without an integer); of every guess: ``in_range`` (inside
the interval the feedback so far allows) and ``bisect`` (at its midpoint, rounded either way): the
strategy the reward favours, logged as ``env/bisect``.

Training groups: ``group_size`` episodes sharing one secret (so advantages compare strategies on the
same number). Secrets are uniform over 1..100 minus the held-out ones the evaluator uses (greedy
play, one episode per held-out secret: ``success``, ``turns``; ``accuracy`` = ``success`` so the
default plots and progress bar show it; and ``sampled_success``, the success rate at temperature 1
over a few fixed-seed episodes per held-out secret, a finer-grained measure of the same policy).
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


def bisection_opening(secret: int, k: int) -> list[Message]:
    """Up to ``k`` scripted midpoint guesses with their feedback (stopping before the one that would
    hit the secret): a game already under way, for training on later turns."""
    lo, hi = LOW, HIGH
    msgs: list[Message] = []
    for _ in range(k):
        guess = (lo + hi) // 2
        if guess == secret:
            break
        msgs.append({"role": "assistant", "content": f"Is it {guess}?"})
        msgs.append({"role": "user", "content": "Higher." if guess < secret else "Lower."})
        lo, hi = (guess + 1, hi) if guess < secret else (lo, guess - 1)
    return msgs


class GuessNumberEnv(MessageEnv):
    """One game; ``opening`` scripted midpoint guesses are already played (they count as turns)."""

    def __init__(
        self, renderer: Renderer, secret: int, max_turns: int = 7, shaping: float = 0.1, opening: int = 0
    ) -> None:
        super().__init__(renderer)
        if not LOW <= secret <= HIGH:
            raise ValueError(f"secret must be in {LOW}..{HIGH}, got {secret}")
        if not 0 <= opening < max_turns:
            raise ValueError(f"need 0 <= opening < max_turns, got opening={opening}, max_turns={max_turns}")
        self.secret, self.max_turns, self.shaping, self.opening = secret, max_turns, shaping, opening
        self.turns = 0
        self.lo, self.hi = LOW, HIGH  # what the feedback so far says about the secret

    def _narrow(self, guess: int) -> None:
        if guess < self.secret:
            self.lo = max(self.lo, guess + 1)
        elif guess > self.secret:
            self.hi = min(self.hi, guess - 1)

    def initial_messages(self) -> list[Message]:
        history = bisection_opening(self.secret, self.opening)
        self.turns = len(history) // 2
        self.lo, self.hi = LOW, HIGH
        for m in history[::2]:
            self._narrow(int(parse_guess(m["content"]) or 0))
        return [{"role": "user", "content": PROMPT}, *history]

    def _end(self, success: bool, move: dict[str, float], invalid: bool = False) -> Reply:
        reward = max(0.0, 1.0 - self.shaping * (self.turns - 1)) if success else 0.0
        metrics = {"success": float(success), "turns": float(self.turns), "invalid": float(invalid)}
        return Reply(reward, True, metrics={**move, **metrics})

    async def respond(self, reply: Message, ended: bool) -> Reply:
        self.turns += 1
        guess = parse_guess(reply["content"])
        if guess is None:
            return self._end(False, {"in_range": 0.0, "bisect": 0.0}, invalid=True)
        # per-guess strategy metrics: inside what the feedback allows, at its midpoint
        move = {
            "in_range": float(self.lo <= guess <= self.hi),
            "bisect": float(guess in ((self.lo + self.hi) // 2, (self.lo + self.hi + 1) // 2)),
        }
        self._narrow(guess)
        if guess == self.secret:
            return self._end(True, move)
        if self.turns >= self.max_turns:
            return self._end(False, move)
        hint = "Higher." if guess < self.secret else "Lower."
        return Reply(0.0, False, [{"role": "user", "content": hint}], metrics=move)


class GuessNumberGroup(EnvGroupBuilder):
    """One episode per entry of ``secrets`` (a training group repeats one secret), from ``opening``."""

    def __init__(
        self, renderer: Renderer, secrets: Sequence[int], max_turns: int, shaping: float, opening: int = 0
    ) -> None:
        self.renderer, self.secrets, self.max_turns, self.shaping = (
            renderer,
            list(secrets),
            max_turns,
            shaping,
        )
        self.opening = opening

    async def make_envs(self) -> Sequence[Env]:
        return [
            GuessNumberEnv(self.renderer, s, self.max_turns, self.shaping, self.opening) for s in self.secrets
        ]

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
        max_opening: int = 0,
    ) -> None:
        self.renderer, self.n, self.size, self.seed = renderer, groups_per_step, group_size, seed
        self.max_turns, self.shaping = max_turns, shaping
        self.max_opening = min(max_opening, max_turns - 1)
        self.secrets = [s for s in range(LOW, HIGH + 1) if s not in set(held_out)]

    def batch(self, step: int) -> list[EnvGroupBuilder]:
        rng = random.Random(f"guess_number/{self.seed}/{step}")
        out: list[EnvGroupBuilder] = []
        for _ in range(self.n):
            secret, opening = rng.choice(self.secrets), rng.randint(0, self.max_opening)
            out.append(
                GuessNumberGroup(self.renderer, [secret] * self.size, self.max_turns, self.shaping, opening)
            )
        return out


def make_evaluator(
    renderer: Renderer, secrets: Sequence[int], *, max_turns: int = 7, max_tokens: int = 12, samples: int = 4
):
    """One greedy episode per secret: ``success`` (= ``accuracy``), mean guesses ``turns``, ``invalid``
    rate; and ``samples`` episodes per secret at temperature 1 (fixed seed): ``sampled_success``,
    ``sampled_turns``, and per guess ``sampled_bisect`` / ``sampled_in_range``."""
    greedy = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    sampled = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    group = GuessNumberGroup(renderer, secrets, max_turns, shaping=0.0)
    many = GuessNumberGroup(renderer, [s for s in secrets for _ in range(samples)], max_turns, shaping=0.0)

    def rate(g: Any, key: str) -> float:
        last = [t.transitions[-1].metrics for t in g.trajectories]
        return sum(m[key] for m in last) / max(1, len(last))

    def per_guess(g: Any, key: str) -> float:
        vals = [tr.metrics[key] for t in g.trajectories for tr in t.transitions if key in tr.metrics]
        return sum(vals) / max(1, len(vals))

    async def evaluate(policy: Any, step: int) -> dict[str, float]:
        g = await rollout_group(group, policy, greedy, seed=0)
        out = {
            "accuracy": rate(g, "success"),
            "success": rate(g, "success"),
            "turns": rate(g, "turns"),
            "invalid": rate(g, "invalid"),
            "errors": float(g.errors),
        }
        if samples > 0:
            gs = await rollout_group(many, policy, sampled, seed=EVAL_SEED)
            out["sampled_success"] = rate(gs, "success")
            out["sampled_turns"] = rate(gs, "turns")
            out["sampled_bisect"] = per_guess(gs, "bisect")
            out["sampled_in_range"] = per_guess(gs, "in_range")
        return out

    return evaluate


def build(renderer: Renderer, cfg: Any) -> tuple[RLDataset, Any]:
    """Registry entry. ``cfg.extra``: ``max_turns`` (7), ``shaping`` (0.1), ``eval_secrets`` (25),
    ``eval_samples`` (4 sampled episodes per held-out secret)."""
    extra = getattr(cfg, "extra", None) or {}
    max_turns = int(extra.get("max_turns", 7))
    max_opening = int(extra.get("max_opening", 0))
    shaping = float(extra.get("shaping", 0.1))
    held = held_out_secrets(int(extra.get("eval_secrets", 25)))
    dataset = GuessNumberDataset(
        renderer, cfg.groups_per_step, cfg.group_size,
        seed=cfg.seed, max_turns=max_turns, shaping=shaping, held_out=held, max_opening=max_opening,
    )  # fmt: skip
    samples = int(extra.get("eval_samples", 4))
    return dataset, make_evaluator(
        renderer, held, max_turns=max_turns, max_tokens=cfg.max_tokens, samples=samples
    )
