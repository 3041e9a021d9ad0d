"""Success replay (self-imitation): keep the best trajectories of past groups and keep learning
from them.

With a sparse reward, a success is rare: a group-relative update from the one batch it appeared in
moves the policy only a little before the next batch brings no signal again. A success replay
keeps each group's best trajectory (when it beat the rest of its group and earned a positive
reward) in a bounded buffer, and adds a few of them to every later step as cross-entropy datums
weighted on their action tokens only (Oh et al., 2018, "Self-Imitation Learning"; RAFT). The
fresh data still trains with the configured RL loss; the buffer is saved with each checkpoint so
that a resumed run continues exactly.
"""

from __future__ import annotations

import json
import random
from collections import deque
from pathlib import Path

from tinker import types

from opentinker.data import supervised_datum
from opentinker.rl.datums import trajectory_segments
from opentinker.rl.types import TrajectoryGroup


class SuccessReplay:
    def __init__(self, capacity: int, per_step: int, weight: float, seed: int = 0) -> None:
        if capacity < 0 or per_step < 0 or weight <= 0:
            raise ValueError(
                f"replay: capacity and per_step must be >= 0 and weight > 0, got {capacity}, {per_step}, {weight}"
            )
        self.capacity, self.per_step, self.weight, self.seed = capacity, per_step, weight, seed
        self.items: deque[tuple[list[int], list[bool]]] = deque(maxlen=max(1, capacity))

    def add(self, groups: list[TrajectoryGroup]) -> int:
        """Keep each group's best trajectory if it earned > 0 and beat the group's mean."""
        added = 0
        for g in groups:
            rewards = g.rewards_G
            if len(rewards) < 2:
                continue
            best = max(range(len(rewards)), key=rewards.__getitem__)
            if rewards[best] > 0 and rewards[best] > sum(rewards) / len(rewards):
                for tokens, _, act in trajectory_segments(g.trajectories[best]):
                    self.items.append((tokens, act))
                    added += 1
        return added

    def datums(self, step: int) -> list[types.Datum]:
        if not self.items or self.per_step == 0:
            return []
        rng = random.Random(f"replay/{self.seed}/{step}")
        picked = rng.sample(list(self.items), min(self.per_step, len(self.items)))
        return [supervised_datum(t, [self.weight if a else 0.0 for a in act]) for t, act in picked]

    def save(self, path: Path) -> None:
        path.write_text(json.dumps([[t, a] for t, a in self.items]))

    def load(self, path: Path) -> None:
        if path.exists():
            self.items.extend((list(t), list(a)) for t, a in json.loads(path.read_text()))
