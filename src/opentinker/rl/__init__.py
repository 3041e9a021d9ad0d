"""RL: the contract (rl/types.py), rollouts, group-relative advantages, datums, the update step and
the training loops (sync and async, single- and multi-agent)."""

from opentinker.rl.advantages import group_advantages, is_constant
from opentinker.rl.datums import build_datums, rl_datums, trajectory_segments
from opentinker.rl.loop import RLConfig, RLResult, learning_rate_at, run_rl, run_rl_many, train_rl
from opentinker.rl.multiagent import play_game, run_multiagent
from opentinker.rl.rollout import SamplerError, group_metrics, rollout_group
from opentinker.rl.timeline import Timeline, TimelineError, merge_timelines
from opentinker.rl.train_step import train_step
from opentinker.rl.types import (
    Env,
    EnvGroupBuilder,
    Evaluator,
    GameGroupBuilder,
    MessageEnv,
    MultiAgentDataset,
    MultiAgentEnv,
    MultiAgentTask,
    Reply,
    RLDataset,
    ScriptedPolicy,
    StepResult,
    Trajectory,
    TrajectoryGroup,
    Transition,
)

__all__ = [
    "Env", "EnvGroupBuilder", "Evaluator", "GameGroupBuilder", "MessageEnv", "MultiAgentDataset",
    "MultiAgentEnv", "MultiAgentTask", "RLConfig", "RLDataset", "RLResult", "Reply", "SamplerError",
    "ScriptedPolicy", "StepResult", "Timeline", "TimelineError", "Trajectory", "TrajectoryGroup", "Transition", "build_datums",
    "group_advantages", "group_metrics", "is_constant", "learning_rate_at", "merge_timelines", "play_game", "rl_datums",
    "rollout_group", "run_multiagent", "run_rl", "run_rl_many", "train_rl", "train_step",
    "trajectory_segments",
]  # fmt: skip
