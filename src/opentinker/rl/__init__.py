"""RL: environments, rollouts, group-relative advantages, the training loop (sync and async)."""

from opentinker.rl.advantages import group_advantages, is_constant
from opentinker.rl.env import Env, EnvGroupBuilder, MessageEnv, Reply, RLDataset, StepResult
from opentinker.rl.loop import RLConfig, RLResult, run_rl, run_rl_many, train_rl
from opentinker.rl.rollout import TrajectoryGroup, rollout_group

__all__ = [
    "Env", "EnvGroupBuilder", "MessageEnv", "RLConfig", "RLDataset", "RLResult", "Reply", "StepResult",
    "TrajectoryGroup", "group_advantages", "is_constant", "rollout_group", "run_rl", "run_rl_many", "train_rl",
]  # fmt: skip
