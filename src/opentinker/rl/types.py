"""The RL contract in one place: environments, what an episode leaves behind, and the builders a
loop asks for data. Everything else in ``opentinker.rl`` (rollouts, datums, loops) is written
against these types; a task implements the abstract ones.

Shape suffixes name what a list runs over: ``_T`` tokens of one sequence (time), ``_G`` the
members of one group. Tokens are ints of the policy's tokenizer; logprobs are the sampler's, one
per sampled token.

**Single agent.** An :class:`Env` is one episode: ``initial_observation() -> ob_T``, then
``step(ac_T) -> StepResult`` until ``done``. Its observation is the *whole* context the policy is
prompted with, history included. A :class:`MessageEnv` speaks chat messages and builds that
context through a renderer: each turn's observation is the previous observation + the sampled
action + the environment's reply, so a multi-turn chat is one token sequence. An episode yields a
:class:`Trajectory` of :class:`Transition` s. An :class:`EnvGroupBuilder` makes the environments
whose trajectories are compared with each other (group-relative advantages; a
:class:`TrajectoryGroup`) and may add group-level rewards; an :class:`RLDataset` hands out a
step's group builders, deterministically in the step.

**Multi-agent.** A :class:`MultiAgentEnv` is one game between named agents (one policy each): a
coordinator says whose turn it is, that agent sees its own observation and answers with one
message; at the end each agent gets a reward. A :class:`ScriptedPolicy` may play an agent (never
trained). :class:`GameGroupBuilder` and :class:`MultiAgentDataset` are the group/dataset builders;
a game yields a :class:`GameResult` (one :class:`Trajectory` per agent), a group a
:class:`GameGroup`. A ``kind="multiagent"`` task returns a :class:`MultiAgentTask`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentinker.renderers import Message, Renderer

StopCondition = list[int] | list[str]  # token ids or strings that end a sampled action
Evaluator = Callable[[Any, int], Awaitable[dict[str, float]]]  # (sampling client, step) -> metrics
# (sampling clients by agent name, step) -> metrics; keys naming an agent are best "<agent>/<metric>"
MultiAgentEvaluator = Callable[[dict[str, Any], int], Awaitable[dict[str, float]]]


# ---------------------------------------------------------------------------------- episodes


@dataclass
class Transition:
    """One turn (one LLM call): ``ob_T`` the whole context the policy was prompted with (history
    included), ``ac_T`` the sampled tokens, ``logprobs_T`` the sampler's logprob of each of them.
    ``extends``: the index of an earlier call of the episode whose context + output this call's
    context claims to start with (checked when the episode's calls are merged into training
    sequences, rl/timeline.py); None = no claim (extensions are still found and merged)."""

    ob_T: list[int]
    ac_T: list[int]
    logprobs_T: list[float]
    reward: float = 0.0
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    extends: int | None = None

    def __post_init__(self) -> None:
        if len(self.ac_T) != len(self.logprobs_T):
            raise ValueError(
                f"transition: {len(self.ac_T)} action tokens but {len(self.logprobs_T)} logprobs"
            )


@dataclass
class Trajectory:
    """One agent's episode: its transitions in order (a policy-version tag for staleness)."""

    transitions: list[Transition] = field(default_factory=list)
    final_reward: float = 0.0  # added by the group (e.g. a game's outcome) on top of per-step rewards
    policy_version: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def total_reward(self) -> float:
        return sum(t.reward for t in self.transitions) + self.final_reward

    @property
    def num_action_tokens(self) -> int:
        return sum(len(t.ac_T) for t in self.transitions)


@dataclass
class TrajectoryGroup:
    """The finished episodes of one group (failed ones dropped and counted in ``errors``; what
    each failure raised in ``failures``, one line each)."""

    trajectories: list[Trajectory]
    tags: list[str] = field(default_factory=list)
    errors: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def rewards_G(self) -> list[float]:
        return [t.total_reward for t in self.trajectories]


# ---------------------------------------------------------------------------------- environments


@dataclass
class StepResult:
    reward: float
    done: bool
    next_ob_T: list[int] = field(default_factory=list)  # the whole next context (needed unless done)
    metrics: dict[str, float] = field(default_factory=dict)
    extends: int | None = None  # the next call's claim: it extends call k's context + output


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
        self._ob_T: list[int] = []
        self.messages: list[Message] = []

    @abstractmethod
    def initial_messages(self) -> list[Message]: ...

    @abstractmethod
    async def respond(self, reply: Message, ended: bool) -> Reply:
        """``ended`` is False when the reply was cut by the token limit."""

    async def initial_observation(self) -> list[int]:
        self.messages = list(self.initial_messages())
        self._ob_T = self.renderer.build_generation_prompt(self.messages)
        return self._ob_T

    async def step(self, action: list[int]) -> StepResult:
        reply, ended = self.renderer.parse_response(action)
        self.messages.append(reply)
        out = await self.respond(reply, ended)
        if out.done:
            return StepResult(out.reward, True, metrics=out.metrics)
        self.messages += out.messages
        self._ob_T = self._ob_T + list(action) + self.renderer.next_turn_tokens(ended, out.messages)
        return StepResult(out.reward, False, self._ob_T, out.metrics)


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


# ---------------------------------------------------------------------------------- multi-agent


class MultiAgentEnv(ABC):
    """One game between named agents. Subclasses implement the game at the message level; the
    token level (:meth:`observation`, :meth:`step`) is built on it. By default every turn's prompt
    is rendered afresh (a board game: each move's prompt is the position); with ``continue_chat``
    an agent's turns form one conversation (its previous prompt + its reply + the new messages),
    so its whole game is one token sequence, as in :class:`MessageEnv`."""

    agents: tuple[str, ...] = ()
    continue_chat: bool = False

    def __init__(self, renderer: Renderer) -> None:
        self.renderer = renderer
        self.stop = renderer.stop
        self._ctx: dict[str, list[int]] = {}
        self._ended: dict[str, bool] = {}

    # -- the game ---------------------------------------------------------------------------------
    async def reset(self) -> None:
        """Start the game (called once, before the first turn)."""
        self._ctx.clear()
        self._ended.clear()

    @abstractmethod
    def current_agent(self) -> str | None:
        """The coordinator: the agent to move now, or None when the game is over."""

    @abstractmethod
    def observe(self, agent: str) -> list[Message]:
        """What ``agent`` is prompted with now: the whole prompt, or with ``continue_chat`` only the
        messages that are new to it since its last reply."""

    @abstractmethod
    async def act(self, agent: str, reply: Message, ended: bool) -> dict[str, float]:
        """Apply ``agent``'s reply (``ended``: False when cut by the token limit); per-move metrics."""

    @abstractmethod
    def rewards(self) -> dict[str, float]:
        """Each agent's reward, once the game is over."""

    def move_rewards(self, agent: str) -> list[float] | None:
        """Optional, once the game is over: ``agent``'s reward split over its moves (one value per
        move it made, summing to its :meth:`rewards`), for per-move advantages. Default None (the
        whole reward on its last move)."""
        return None

    def metrics(self) -> dict[str, float]:
        """Game-level metrics, once the game is over (logged as ``game/<key>``, mean over games)."""
        return {}

    # -- tokens -----------------------------------------------------------------------------------
    def observation(self, agent: str) -> list[int]:
        """The token prompt of ``agent``'s turn."""
        msgs = self.observe(agent)
        prev = self._ctx.get(agent)
        if self.continue_chat and prev is not None:
            ob_T = prev + self.renderer.next_turn_tokens(self._ended[agent], msgs)
        else:
            ob_T = self.renderer.build_generation_prompt(msgs)
        self._ctx[agent] = ob_T
        return ob_T

    async def step(self, agent: str, action: list[int]) -> dict[str, float]:
        """Apply sampled tokens as ``agent``'s reply."""
        reply, ended = self.renderer.parse_response(action)
        if self.continue_chat:
            self._ctx[agent] = self._ctx.get(agent, []) + list(action)
            self._ended[agent] = ended
        return await self.act(agent, reply, ended)


class ScriptedPolicy(ABC):
    """A policy that is not a model (a random or rule-based opponent): it answers from the game's
    state. Its moves are not recorded and never trained on."""

    @abstractmethod
    async def reply(self, env: MultiAgentEnv, agent: str) -> str: ...


class GameGroupBuilder(ABC):
    """Makes the games of one group (their per-agent rewards are compared for advantages)."""

    @abstractmethod
    async def make_games(self) -> Sequence[MultiAgentEnv]: ...

    def scripted(self, game: int) -> Mapping[str, ScriptedPolicy]:
        """Agents played by a script instead of their policy in game ``game`` of this group (an
        opponent pool: e.g. a random opponent in some games). Default: none."""
        return {}

    def tags(self) -> list[str]:
        return []


class MultiAgentDataset(ABC):
    """``batch(step)``: the game groups of one step, deterministic in ``step``."""

    @abstractmethod
    def batch(self, step: int) -> list[GameGroupBuilder]: ...


@dataclass
class MultiAgentTask:
    """What a ``kind="multiagent"`` task's ``build(renderer, cfg)`` returns."""

    agents: tuple[str, ...]
    dataset: MultiAgentDataset
    evaluator: MultiAgentEvaluator | None = None
    plot_keys: tuple[str, ...] = ()  # per-agent keys without the agent prefix, e.g. "eval/win_rate"
    show_keys: tuple[str, ...] = ()  # progress-bar keys, e.g. "game/draws"
    per_move_advantages: bool = False  # one advantage per move (return-to-go), see per_move_datums


@dataclass
class GameResult:
    trajectories: dict[str, Trajectory]  # one per agent (empty when the agent never moved)
    rewards: dict[str, float]
    metrics: dict[str, float]


@dataclass
class GameGroup:
    games: list[GameResult]
    tags: list[str] = field(default_factory=list)
    errors: int = 0
    failures: list[str] = field(default_factory=list)  # what each failed game raised, one line each

    def trajectory_group(self, agent: str) -> TrajectoryGroup:
        """``agent``'s trajectories in this group's games (games where it never moved left out)."""
        trajs = [g.trajectories[agent] for g in self.games if g.trajectories[agent].transitions]
        return TrajectoryGroup(trajs, list(self.tags))
