"""RL: environments, rollouts, group-relative advantages, the training loop (sync and async)."""

from opentinker.rl.advantages import group_advantages, is_constant
from opentinker.rl.env import Env, EnvGroupBuilder, MessageEnv, Reply, RLDataset, StepResult
from opentinker.rl.loop import RLConfig, RLResult, learning_rate_at, run_rl, run_rl_many, train_rl
from opentinker.rl.multiagent import MultiAgentEnv, MultiAgentTask, ScriptedPolicy, play_game, run_multiagent
from opentinker.rl.rollout import TrajectoryGroup, rollout_group

__all__ = [
    "Env",
    "EnvGroupBuilder",
    "MessageEnv",
    "MultiAgentEnv",
    "MultiAgentTask",
    "RLConfig",
    "RLDataset",
    "RLResult",
    "Reply",
    "ScriptedPolicy",
    "StepResult",
    "TrajectoryGroup",
    "group_advantages",
    "is_constant",
    "learning_rate_at",
    "play_game",
    "rollout_group",
    "run_multiagent",
    "run_rl",
    "run_rl_many",
    "train_rl",
]  # fmt: skip
