"""Reply length control: the reward is how close the reply's word count is to a target.

The reward is measured on the *ratio* of words to target (``1 / (1 + log2(n / target)^2)``): 1 on
target, 1/2 at twice or half of it, 1/5 at four times, never 0 for a finished reply. So it is
sharp enough that neighbouring targets (a factor 2-3 apart) earn clearly less than the own one,
symmetric so that undershoot costs as much as overshoot, and still ranks replies far from the
target, so a policy that starts at ~90 words (SmolLM2's habit) gets a direction from the start.
A reply cut by the token limit or an empty one earns 0, below every finished reply: with a token
limit well above the largest target, a cut reply overshoots every target anyway.

The reward counts words only, so the shortest adapters may answer with fragments ("Awful.",
"1.1.1.1"): it is a length objective, not a quality one. The main demo trains several adapters on
the same prompts, each towards its own target length, in one run. ``cfg.extra["target_words"]``
sets the target.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence
from typing import Any

from tinker import types

from opentinker.renderers import Message, Renderer
from opentinker.rl.types import Env, EnvGroupBuilder, MessageEnv, Reply, RLDataset

QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "How do plants make food?",
    "What is a good name for a cat?", "Describe the ocean.", "What is your favourite season?",
    "How does a bicycle work?", "Tell me about the moon.", "What do bees do?",
    "Why do we sleep?", "What is music?", "How are rainbows made?", "Describe a forest.",
    "What is a computer?", "Why do leaves change colour?", "What is friendship?",
    "How do birds fly?", "Tell me about volcanoes.", "What is the sun?", "Describe your morning.",
    "What makes a good teacher?", "How is bread made?", "What is a river?", "Why is water wet?",
    "What is the best way to learn?", "Describe a city at night.", "What are clouds made of?",
    "How do fish breathe?", "What is a library?", "Tell me about winter.", "What is chess?",
    "How does rain form?", "What is kindness?", "Describe a mountain.", "What is electricity?",
    "Why do cats purr?", "What is a planet?", "How do you make tea?", "What is a dream?",
    "Tell me about the desert.", "What is a museum?", "How do trees grow?",
]  # fmt: skip
EVAL = QUESTIONS[-10:]
TRAIN = QUESTIONS[:-10]
# Shared by every adapter, so they differ only in what they learned. It starts SmolLM2 at ~40 words
# (measured at T = 1: 10% under 16, 10% over 56, a third cut at 64 tokens) instead of at ~90 words
# where nearly every reply is cut: the targets then have finished replies to compare from the
# first step, and the adapters must move apart, most of them shorter.
SYSTEM = "Answer in one sentence."


def prompt_messages(question: str) -> list[Message]:
    """The conversation every policy (adapter or base) answers: the shared system line, the question."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def length_reward(text: str, target: int) -> float:
    """``1 / (1 + log2(n / target)^2)`` for a reply of n >= 1 words, 0 for an empty one."""
    if target < 1:
        raise ValueError(f"target must be >= 1 word, got {target}")
    n = len(text.split())
    return 1.0 / (1.0 + math.log2(n / target) ** 2) if n else 0.0


class LengthEnv(MessageEnv):
    def __init__(self, renderer: Renderer, question: str, target: int) -> None:
        super().__init__(renderer)
        self.question, self.target = question, target

    def initial_messages(self) -> list[Message]:
        return prompt_messages(self.question)

    async def respond(self, reply: Message, ended: bool) -> Reply:
        # a reply cut by the token limit earns nothing: otherwise "one endless word" games the count
        r = length_reward(reply["content"], self.target) if ended else 0.0
        return Reply(r, True, metrics={"words": float(len(reply["content"].split())), "ended": float(ended)})


class LengthGroup(EnvGroupBuilder):
    def __init__(self, renderer: Renderer, question: str, target: int, size: int) -> None:
        self.renderer, self.question, self.target, self.size = renderer, question, target, size

    async def make_envs(self) -> Sequence[Env]:
        return [LengthEnv(self.renderer, self.question, self.target) for _ in range(self.size)]

    def tags(self) -> list[str]:
        return [f"length{self.target}"]


class LengthDataset(RLDataset):
    def __init__(
        self, renderer: Renderer, target: int, groups_per_step: int, group_size: int, seed: int
    ) -> None:
        self.renderer, self.target, self.n, self.size, self.seed = (
            renderer,
            target,
            groups_per_step,
            group_size,
            seed,
        )

    def batch(self, step: int) -> list[EnvGroupBuilder]:
        rng = random.Random(f"length/{self.seed}/{step}")
        return [LengthGroup(self.renderer, q, self.target, self.size) for q in rng.sample(TRAIN, self.n)]


def make_evaluator(renderer: Renderer, target: int, max_tokens: int):
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=renderer.stop)

    async def evaluate(policy: Any, step: int) -> dict[str, float]:
        async def one(q: str) -> tuple[float, float]:
            prompt = renderer.build_generation_prompt(prompt_messages(q))
            resp = await policy.sample(
                prompt=types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params
            )
            msg, ended = renderer.parse_response(list(resp.sequences[0].tokens))
            text = msg["content"]
            return (length_reward(text, target) if ended else 0.0), float(len(text.split()))

        out = await asyncio.gather(*(one(q) for q in EVAL))
        return {"reward": sum(r for r, _ in out) / len(out), "words": sum(w for _, w in out) / len(out)}

    return evaluate


def build(renderer: Renderer, cfg: Any) -> tuple[RLDataset, Any]:
    target = int(cfg.extra.get("target_words", 5))
    if target < 1:
        raise ValueError(f"target_words must be >= 1, got {target}")
    return (
        LengthDataset(renderer, target, cfg.groups_per_step, cfg.group_size, cfg.seed),
        make_evaluator(renderer, target, cfg.max_tokens),
    )
