"""What an episode leaves behind: per turn, the observation the policy saw and the action it took."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Transition:
    """One turn. ``ob`` is the whole context the policy was prompted with (history included);
    ``ac`` the sampled tokens with the sampler's logprob of each."""

    ob: list[int]
    ac: list[int]
    ac_logprobs: list[float]
    reward: float = 0.0
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.ac) != len(self.ac_logprobs):
            raise ValueError(f"transition: {len(self.ac)} action tokens but {len(self.ac_logprobs)} logprobs")


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
        return sum(len(t.ac) for t in self.transitions)
