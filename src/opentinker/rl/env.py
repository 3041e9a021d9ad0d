"""Environments: observation -> action -> reward, done, next observation.

Two levels. A token-level :class:`Env` sees and returns token lists (its observation is the whole
context the policy is prompted with). A message-level :class:`MessageEnv` speaks chat messages and
is turned into tokens by a renderer: each turn's observation is the previous observation + the
sampled action + the environment's reply, so a multi-turn episode is one token sequence.

Groups: an :class:`EnvGroupBuilder` makes the environments whose trajectories are compared with each
other (group-relative advantages), and may add group-level rewards (e.g. a game's outcome). An
:class:`RLDataset` hands out a batch of group builders per step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from opentinker.data import Trajectory
from opentinker.renderers import Message, Renderer

StopCondition = list[int] | list[str]


@dataclass
class StepResult:
    reward: float
    done: bool
    next_ob: list[int] = field(default_factory=list)  # the whole next context (needed unless done)
    metrics: dict[str, float] = field(default_factory=dict)


class Env(ABC):
    """One episode of a token-level environment. ``stop`` ends each sampled action."""

    stop: StopCondition | None = None

    @abstractmethod
    async def initial_observation(self) -> list[int]: ...

    @abstractmethod
    async def step(self, action: list[int]) -> StepResult: ...


@dataclass
class Reply:
    """A message-level environment's answer to the policy's message."""

    reward: float
    done: bool
    messages: list[Message] = field(default_factory=list)  # the environment's next turn(s)
    metrics: dict[str, float] = field(default_factory=dict)


class MessageEnv(Env):
    """A chat environment; subclasses give the opening messages and answer each assistant reply."""

    def __init__(self, renderer: Renderer) -> None:
        self.renderer = renderer
        self.stop = renderer.stop
        self._ob: list[int] = []
        self.messages: list[Message] = []

    @abstractmethod
    def initial_messages(self) -> list[Message]: ...

    @abstractmethod
    async def respond(self, reply: Message, ended: bool) -> Reply:
        """``ended`` is False when the reply was cut by the token limit."""

    async def initial_observation(self) -> list[int]:
        self.messages = list(self.initial_messages())
        self._ob = self.renderer.build_generation_prompt(self.messages)
        return self._ob

    async def step(self, action: list[int]) -> StepResult:
        reply, ended = self.renderer.parse_response(action)
        self.messages.append(reply)
        out = await self.respond(reply, ended)
        if out.done:
            return StepResult(out.reward, True, metrics=out.metrics)
        self.messages += out.messages
        self._ob = self._ob + list(action) + self.renderer.next_turn_tokens(ended, out.messages)
        return StepResult(out.reward, False, self._ob, out.metrics)


class EnvGroupBuilder(ABC):
    """Makes the environments of one group (compared with each other for advantages)."""

    @abstractmethod
    async def make_envs(self) -> Sequence[Env]: ...

    def group_rewards(self, trajectories: list[Trajectory]) -> list[float]:
        """Rewards that depend on the whole group (added to each trajectory's total). Default 0."""
        return [0.0] * len(trajectories)

    def tags(self) -> list[str]:
        """Names under which this group's metrics are also logged (e.g. the task)."""
        return []


class RLDataset(ABC):
    """The training problems: ``batch(step)`` group builders per step, deterministic in ``step``."""

    @abstractmethod
    def batch(self, step: int) -> list[EnvGroupBuilder]: ...
