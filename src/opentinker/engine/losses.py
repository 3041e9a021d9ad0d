"""Tinker's built-in losses, per datum, as plain token **sums** (no length normalisation).

Notation: ``lp`` = learner logprobs of the targets (differentiable), ``q`` = sampler logprobs
(``inputs["logprobs"]``), ``r = exp(lp - q)``, ``A`` = advantages, ``sg`` = stop-gradient.

    cross_entropy        -Σ w·lp                          (targets [T] or soft [T, K] with weights alike)
    importance_sampling  -Σ r·A
    ppo                  -Σ min(r·A, clip(r, lo, hi)·A)
    cispo                -Σ sg(clip(r, lo, hi))·lp·A
    dro                  -Σ [lp·A - ½·β·(lp - q)²]
    gspo                 s = exp(mean_M(sg(lp) - q)); s_t = s·exp(lp_t - sg(lp_t));
                         -Σ min(s_t·A, clip(s_t, lo, hi)·A)       (M = sequence_ratio_mask ≠ 0)

Each function returns the elementwise loss [T]; the engine sums it. ``lo``/``hi`` come from
``loss_fn_config`` (``clip_low_threshold`` 0.8, ``clip_high_threshold`` 1.2) or, per datum, from
``loss_fn_inputs`` of the same names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class LossSpec:
    fn: Callable[[Tensor, dict[str, Tensor], dict[str, float]], Tensor]
    required: tuple[str, ...]  # loss_fn_inputs that must be present
    optional: tuple[str, ...]  # loss_fn_inputs that may be present
    config: dict[str, float]  # loss_fn_config keys and their defaults


def _clip_bounds(like: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> tuple[Tensor, Tensor]:
    lo = inputs.get("clip_low_threshold", torch.tensor(config["clip_low_threshold"]))
    hi = inputs.get("clip_high_threshold", torch.tensor(config["clip_high_threshold"]))
    return lo.to(like), hi.to(like)


def cross_entropy(lp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    w = inputs.get("weights")
    if w is None:
        w = torch.ones_like(lp)
    loss = -(w * lp)
    return loss.sum(-1) if loss.dim() == 2 else loss  # soft targets: sum over K per position


def importance_sampling(lp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    ratio = torch.exp(lp - inputs["logprobs"])
    return -(ratio * inputs["advantages"])


def ppo(lp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    adv = inputs["advantages"]
    ratio = torch.exp(lp - inputs["logprobs"])
    lo, hi = _clip_bounds(lp, inputs, config)
    clipped = torch.clamp(ratio, lo, hi)
    return -torch.minimum(ratio * adv, clipped * adv)


def cispo(lp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    ratio = torch.exp(lp - inputs["logprobs"])
    lo, hi = _clip_bounds(lp, inputs, config)
    return -(torch.clamp(ratio, lo, hi).detach() * lp * inputs["advantages"])


def dro(lp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    q = inputs["logprobs"]
    return -(lp * inputs["advantages"] - 0.5 * config["beta"] * (lp - q) ** 2)


def gspo(lp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    adv = inputs["advantages"]
    q = inputs["logprobs"]
    mask = inputs.get("sequence_ratio_mask")
    in_ratio = (mask != 0) if mask is not None else (adv != 0)
    if bool(in_ratio.any()):
        log_ratio = (lp.detach() - q)[in_ratio].mean()
    else:
        log_ratio = lp.new_zeros(())
    ratio = torch.exp(log_ratio + lp - lp.detach())  # value s, gradient of each token's own lp
    lo, hi = _clip_bounds(lp, inputs, config)
    clipped = torch.clamp(ratio, lo, hi)
    return -torch.minimum(ratio * adv, clipped * adv)


_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_CLIP_INPUTS = ("clip_low_threshold", "clip_high_threshold")
_RL = ("target_tokens", "logprobs", "advantages")

LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ("target_tokens",), ("weights",), {}),
    "importance_sampling": LossSpec(importance_sampling, _RL, (), {}),
    "ppo": LossSpec(ppo, _RL, _CLIP_INPUTS, dict(_CLIP)),
    "cispo": LossSpec(cispo, _RL, _CLIP_INPUTS, dict(_CLIP)),
    "dro": LossSpec(dro, _RL, (), {"beta": 0.05}),
    "gspo": LossSpec(gspo, _RL, ("sequence_ratio_mask", *_CLIP_INPUTS), dict(_CLIP)),
}


def resolve_config(loss_fn: str, config: dict[str, float]) -> dict[str, float]:
    """The loss's config with defaults filled in (the caller has validated the keys)."""
    return {**LOSSES[loss_fn].config, **{k: float(v) for k, v in config.items()}}
