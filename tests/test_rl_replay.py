"""Success replay (rl/replay.py): which trajectories enter, what their datums train, persistence."""

from __future__ import annotations

from pathlib import Path

from opentinker.rl.replay import SuccessReplay
from opentinker.rl.types import Trajectory, TrajectoryGroup, Transition


def traj(ob: list[int], ac: list[int], reward: float) -> Trajectory:
    return Trajectory([Transition(ob, ac, [-1.0] * len(ac), reward, True)])


def test_only_a_group_best_success_enters_and_trains_on_its_action_tokens(tmp_path: Path) -> None:
    rb = SuccessReplay(capacity=3, per_step=2, weight=0.5, seed=0)
    groups = [
        TrajectoryGroup([traj([1, 2, 3], [7, 8], 1.0), traj([1, 2, 3], [9], 0.0)]),  # best: enters
        TrajectoryGroup([traj([4, 5], [6], 0.0), traj([4, 5], [7], 0.0)]),  # no success
        TrajectoryGroup([traj([4, 5], [6], 1.0), traj([4, 5], [7], 1.0)]),  # all equal: no signal
        TrajectoryGroup([traj([4, 5], [6], -1.0), traj([4, 5], [7], -2.0)]),  # best but not positive
    ]
    assert rb.add(groups) == 1
    [d] = rb.datums(step=0)
    assert d.model_input.to_ints() == [1, 2, 3, 7]
    assert d.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 7, 8]
    assert d.loss_fn_inputs["weights"].tolist() == [0.0, 0.0, 0.5, 0.5]  # context 0, actions weighted


def test_capacity_sampling_and_persistence(tmp_path: Path) -> None:
    rb = SuccessReplay(capacity=3, per_step=2, weight=1.0, seed=1)
    for k in range(5):
        rb.add([TrajectoryGroup([traj([1, 2], [10 + k], 1.0), traj([1, 2], [3], 0.0)])])
    assert [t[-1] for t, _ in rb.items] == [12, 13, 14]  # oldest dropped
    a = [d.model_input.to_ints() for d in rb.datums(step=4)]
    assert a == [d.model_input.to_ints() for d in rb.datums(step=4)] and len(a) == 2  # seeded per step
    rb.save(tmp_path / "replay.json")
    other = SuccessReplay(capacity=3, per_step=2, weight=1.0, seed=1)
    other.load(tmp_path / "replay.json")
    assert list(other.items) == list(rb.items)
    assert [d.model_input.to_ints() for d in other.datums(step=4)] == a
