"""Reply length control: the reward is how close an on-topic reply's word count is to a target.

The reward is measured on the *ratio* of words to target (``1 / (1 + log2(n / target)^2)``): 1 on
target, 1/2 at twice or half of it, 1/5 at four times, never 0 for a finished reply. So it is
sharp enough that neighbouring targets (a factor 2-3 apart) earn clearly less than the own one,
symmetric so that undershoot costs as much as overshoot, and still ranks replies far from the
target, so a policy that starts at ~90 words (SmolLM2's habit) gets a direction from the start.
A reply cut by the token limit or an empty one earns 0, below every finished reply: with a token
limit above the largest target (the demo: ~1.5 times), a cut reply overshoots every target anyway.

A reply must also keep to the question's topic (:func:`on_topic`: it uses one of the question's
topic words in :data:`TOPICS`, and neither asks a question nor repeats the question: a
deterministic check) or it earns 0. A reward on word counts alone was gamed by dropping the
content: "What is kindness?" got 'finally' from the 1-word adapter and 'No answer available.'
from the 3-word one; with the topic words alone, short adapters learned to repeat the question.
The check does not judge fluency; the main demo adds a KL penalty to the base model for that. The main demo trains several adapters on
the same prompts, each towards its own target length, in one run. ``cfg.extra["target_words"]``
sets the target.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
from collections.abc import Sequence
from typing import Any

from tinker import types

from opentinker.renderers import Message, Renderer
from opentinker.rl.types import Env, EnvGroupBuilder, MessageEnv, Reply, RLDataset

# Each question and its topic: a reply is on topic if one of its words is a stem (or its plural), or
# starts with a stem of 4 letters or more (see on_topic)
TOPICS: dict[str, tuple[str, ...]] = {
    "What is the capital of France?": ("france", "french", "paris"),
    "Why is the sky blue?": ("sky", "skies", "blue"),
    "How do plants make food?": ("plant", "photosynth"),
    "What is a good name for a cat?": ("cat", "kitt", "name"),
    "Describe the ocean.": ("ocean", "sea"),
    "What is your favourite season?": ("season", "spring", "summer", "autumn", "fall", "winter"),
    "How does a bicycle work?": ("bicycle", "bike", "pedal", "cycl"),
    "Tell me about the moon.": ("moon", "lunar"),
    "What do bees do?": ("bee", "honey", "pollen", "pollinat"),
    "Why do we sleep?": ("sleep", "rest"),
    "What is music?": ("music", "sound", "song", "melod"),
    "How are rainbows made?": ("rainbow", "light", "colo"),
    "Describe a forest.": ("forest", "tree", "wood"),
    "What is a computer?": ("computer", "machine"),
    "Why do leaves change colour?": ("leaf", "leaves", "colo", "autumn", "fall"),
    "What is friendship?": ("friend",),
    "How do birds fly?": ("bird", "wing", "fly", "flies", "flight"),
    "Tell me about volcanoes.": ("volcan", "lava", "magma", "erupt"),
    "What is the sun?": ("sun", "star", "solar"),
    "Describe your morning.": ("morning", "wake", "woke", "breakfast", "coffee"),
    "What makes a good teacher?": ("teach",),
    "How is bread made?": ("bread", "flour", "dough", "bak"),
    "What is a river?": ("river", "water", "stream"),
    "Why is water wet?": ("water", "wet"),
    "What is the best way to learn?": ("learn", "practi", "study"),
    "Describe a city at night.": ("city", "night", "cities", "street"),
    "What are clouds made of?": ("cloud", "water", "vapo", "droplet"),
    "How do fish breathe?": ("fish", "gill", "breath"),
    "What is a library?": ("librar", "book"),
    "Tell me about winter.": ("winter", "snow", "cold"),
    "What is chess?": ("chess", "game"),
    "How does rain form?": ("rain", "water", "cloud", "droplet"),
    "What is kindness?": ("kind",),
    "Describe a mountain.": ("mountain", "peak", "summit"),
    "What is electricity?": ("electric", "current", "charge", "energy"),
    "Why do cats purr?": ("cat", "purr"),
    "What is a planet?": ("planet", "orbit"),
    "How do you make tea?": ("tea", "brew", "steep"),
    "What is a dream?": ("dream",),
    "Tell me about the desert.": ("desert", "sand", "dry"),
    "What is a museum?": ("museum", "exhibit", "art"),
    "How do trees grow?": ("tree", "root", "grow", "grew"),
}
QUESTIONS = list(TOPICS)
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


def on_topic(text: str, question: str) -> bool:
    """Whether the reply names the question's topic (:data:`TOPICS`): one of its words is a stem or
    the stem plus "s", or starts with a stem of four letters or more. Case and punctuation ignored.
    A reply that asks a question (ends with "?") or repeats the question's words is not on topic:
    it names the topic without answering."""
    words = re.findall(r"[a-z]+", text.lower())
    if text.rstrip().endswith("?") or words == re.findall(r"[a-z]+", question.lower()):
        return False
    return any(
        w in (s, s + "s") or (len(s) >= 4 and w.startswith(s)) for s in TOPICS[question] for w in words
    )


def reply_reward(text: str, question: str, target: int) -> float:
    """The task's reward for a finished reply: :func:`length_reward` if it is on topic, else 0."""
    return length_reward(text, target) if on_topic(text, question) else 0.0


class LengthEnv(MessageEnv):
    def __init__(self, renderer: Renderer, question: str, target: int) -> None:
        super().__init__(renderer)
        self.question, self.target = question, target

    def initial_messages(self) -> list[Message]:
        return prompt_messages(self.question)

    async def respond(self, reply: Message, ended: bool) -> Reply:
        # a reply cut by the token limit earns nothing: otherwise "one endless word" games the count
        text = reply["content"]
        r = reply_reward(text, self.question, self.target) if ended else 0.0
        metrics = {
            "words": float(len(text.split())),
            "ended": float(ended),
            "on_topic": float(on_topic(text, self.question)),
        }
        return Reply(r, True, metrics=metrics)


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
            return (reply_reward(text, q, target) if ended else 0.0), float(len(text.split()))

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
