"""Learning-rate schedules, one set for every training loop (RL, SFT, DPO).

A schedule scales the configured learning rate by a factor of the run's progress ``p`` in [0, 1]:
``constant`` 1; ``linear`` from 1 down to ``final`` at ``p = 1``; ``cosine`` half a cosine from 1
down to ``final``. SFT and DPO decay to 0 over their steps; RL decays to its ``lr_final``.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def check_schedule(name: str) -> str:
    """``name`` if it is a schedule, else ``ValueError`` naming the choices."""
    if name not in SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {SCHEDULES}, got {name!r}")
    return name


def schedule_factor(name: str, progress: float, final: float = 0.0) -> float:
    """The factor on the learning rate at ``progress`` (0: the start, 1: the end) under schedule
    ``name``, ending at ``final``."""
    check_schedule(name)
    if name == "constant":
        return 1.0
    if name == "linear":
        return 1.0 - (1.0 - final) * progress
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress))
