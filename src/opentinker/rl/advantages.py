"""Group-relative advantages: each trajectory's reward minus its group's mean (GRPO-style),
optionally divided by the group's standard deviation; groups whose rewards are all equal carry no
signal and can be dropped before any compute is spent on them."""

from __future__ import annotations

import math


def group_advantages(rewards: list[float], *, normalize_std: bool = False, eps: float = 1e-6) -> list[float]:
    if not rewards:
        return []
    bad = [r for r in rewards if not math.isfinite(r)]
    if bad:
        raise ValueError(f"rewards must be finite, got {bad[0]}")
    mean = sum(rewards) / len(rewards)
    adv = [r - mean for r in rewards]
    if normalize_std:
        std = math.sqrt(sum(a * a for a in adv) / len(adv))
        adv = [a / (std + eps) for a in adv]
    return adv


def is_constant(rewards: list[float], tol: float = 1e-9) -> bool:
    return len(rewards) < 2 or max(rewards) - min(rewards) <= tol
