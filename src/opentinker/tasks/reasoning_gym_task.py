"""reasoning-gym's procedural datasets as a task: ``reasoning_gym:<dataset>[?size=N&seed=S&...]``.

The options after ``?`` are the dataset's own config fields, passed to
``reasoning_gym.create_dataset(dataset, **options)`` (``size`` and ``seed`` among them). One
episode is one entry: the user message is its ``question`` (rendered by the model's chat
renderer), the reply is scored by the dataset's own ``score_answer`` (1 for the exact answer; its
default gives partial credit when the answer is inside a longer reply). Single-turn.

``--extra system_prompt=<name>`` adds one of reasoning-gym's ``SYSTEM_PROMPTS`` (e.g. ``direct``)
as a system turn; the answer is then what its ``extract_answer`` finds between ``<answer>`` tags.
Without it (the default) the whole reply is the answer: small models rarely keep to a tag format.

Evaluation: ``eval_problems`` (default 100) entries of the same dataset under another seed,
greedy; training skips any entry whose question is among them. ``eval/accuracy`` is the share
scored 1, ``eval/score`` the mean score.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import reasoning_gym
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer
from tinker import types

from opentinker.renderers import Message, Renderer
from opentinker.rl.types import Env, EnvGroupBuilder, MessageEnv, Reply, RLDataset

EVAL_SEED_OFFSET = 1_000_003  # the held-out entries' seed: the dataset's seed + this


def make_dataset(name: str, options: dict[str, Any]) -> Any:
    """``reasoning_gym.create_dataset`` with an error that names the problem."""
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        import difflib

        near = difflib.get_close_matches(name, list(DATASETS), n=3)
        hint = f" (did you mean {', '.join(near)}?)" if near else f"; {len(DATASETS)} datasets exist"
        raise ValueError(f"reasoning_gym has no dataset {name!r}{hint}")
    try:
        return reasoning_gym.create_dataset(name, **options)
    except (TypeError, ValueError, AssertionError) as e:
        raise ValueError(f"reasoning_gym:{name}: bad options {options}: {e}") from None


class Problems:
    """One dataset's training and held-out entries, and how a reply is scored."""

    def __init__(self, name: str, options: dict[str, Any], eval_problems: int, system_prompt: str | None):
        if system_prompt is not None and system_prompt not in SYSTEM_PROMPTS:
            raise ValueError(f"system_prompt must be one of {sorted(SYSTEM_PROMPTS)}, got {system_prompt!r}")
        self.name, self.system_prompt = name, system_prompt
        self.train = make_dataset(name, options)
        seed = int(options.get("seed", getattr(self.train, "seed", 0) or 0))
        held = {**options, "seed": seed + EVAL_SEED_OFFSET, "size": eval_problems}
        self.held_out = [dict(e) for e in make_dataset(name, held)]
        seen = {e["question"] for e in self.held_out}
        self.entries = [dict(e) for e in self.train if e["question"] not in seen]
        if not self.entries:
            raise ValueError(f"reasoning_gym:{name}: every training entry is also held out; raise size")

    def messages(self, entry: dict[str, Any]) -> list[Message]:
        msgs: list[Message] = []
        if self.system_prompt is not None:
            msgs.append({"role": "system", "content": SYSTEM_PROMPTS[self.system_prompt]})
        msgs.append({"role": "user", "content": str(entry["question"])})
        return msgs

    def answer(self, reply: str) -> str | None:
        """The answer in a reply: between ``<answer>`` tags with a system prompt, else all of it."""
        return extract_answer(reply) if self.system_prompt is not None else reply.strip()

    def score(self, reply: str, entry: dict[str, Any]) -> float:
        """The dataset's own score of ``reply``'s answer."""
        return float(self.train.score_answer(answer=self.answer(reply), entry=entry))


class ReasoningGymEnv(MessageEnv):
    def __init__(self, renderer: Renderer, problems: Problems, entry: dict[str, Any]) -> None:
        super().__init__(renderer)
        self.problems, self.entry = problems, entry

    def initial_messages(self) -> list[Message]:
        return self.problems.messages(self.entry)

    async def respond(self, reply: Message, ended: bool) -> Reply:
        r = self.problems.score(reply["content"], self.entry)
        return Reply(r, True, metrics={"score": r, "correct": float(r == 1.0)})


class ReasoningGymGroup(EnvGroupBuilder):
    def __init__(self, renderer: Renderer, problems: Problems, entry: dict[str, Any], size: int) -> None:
        self.renderer, self.problems, self.entry, self.size = renderer, problems, entry, size

    async def make_envs(self) -> Sequence[Env]:
        return [ReasoningGymEnv(self.renderer, self.problems, self.entry) for _ in range(self.size)]

    def tags(self) -> list[str]:
        return [self.problems.name]


class ReasoningGymDataset(RLDataset):
    """Step ``s`` takes the next ``groups_per_step`` training entries, in an order fixed by ``seed``
    (wrapping around the dataset)."""

    def __init__(
        self, renderer: Renderer, problems: Problems, groups_per_step: int, group_size: int, seed: int
    ):
        import random

        self.renderer, self.problems, self.n, self.size = renderer, problems, groups_per_step, group_size
        self.order = list(range(len(problems.entries)))
        random.Random(f"reasoning_gym/{problems.name}/{seed}").shuffle(self.order)

    def batch(self, step: int) -> list[EnvGroupBuilder]:
        at = step * self.n
        picks = [self.order[(at + k) % len(self.order)] for k in range(self.n)]
        return [
            ReasoningGymGroup(self.renderer, self.problems, self.problems.entries[i], self.size)
            for i in picks
        ]


def make_evaluator(renderer: Renderer, problems: Problems, max_tokens: int):
    """Greedy replies to the held-out entries: ``accuracy`` (share scored 1) and mean ``score``."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=renderer.stop)

    async def evaluate(policy: Any, step: int) -> dict[str, float]:
        async def one(entry: dict[str, Any]) -> float:
            prompt = renderer.build_generation_prompt(problems.messages(entry))
            resp = await policy.sample(
                prompt=types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params
            )
            text = renderer.parse_response(list(resp.sequences[0].tokens))[0]["content"]
            return problems.score(text, entry)

        scores = await asyncio.gather(*(one(e) for e in problems.held_out))
        return {
            "accuracy": sum(s == 1.0 for s in scores) / len(scores),
            "score": sum(scores) / len(scores),
        }

    return evaluate


def problems_of(environment: str, options: dict[str, Any], cfg: Any) -> Problems:
    n = int(cfg.extra.get("eval_problems", 100))
    if n < 1:
        raise ValueError(f"eval_problems must be >= 1, got {n}")
    return Problems(environment, options, n, cfg.extra.get("system_prompt"))


def build(
    renderer: Renderer, cfg: Any, *, environment: str, options: dict[str, Any]
) -> tuple[RLDataset, Any]:
    """Registry entry (``reasoning_gym:<environment>?<options>``): the dataset and its evaluator."""
    problems = problems_of(environment, options, cfg)
    return (
        ReasoningGymDataset(renderer, problems, cfg.groups_per_step, cfg.group_size, cfg.seed),
        make_evaluator(renderer, problems, cfg.max_tokens),
    )
