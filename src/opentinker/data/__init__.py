"""The data path shared by SFT and RL: trajectories, and token sequences with masks -> Datum."""

from opentinker.data.datum import datum_from_tokens, rl_datums, supervised_datum, trajectory_segments
from opentinker.data.trajectory import Trajectory, Transition

__all__ = [
    "Trajectory",
    "Transition",
    "datum_from_tokens",
    "rl_datums",
    "supervised_datum",
    "trajectory_segments",
]
