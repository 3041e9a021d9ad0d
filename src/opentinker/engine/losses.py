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
    stable_reinforce     -Σ m·sg(w_s)·A·lp, w_s = min(exp(mean_{t∈s}(sg(lp_t) - q_t)), c)   (ours; below)

Each function returns the elementwise loss [T]; the engine sums it. ``lo``/``hi`` come from
``loss_fn_config`` (``clip_low_threshold`` 0.8, ``clip_high_threshold`` 1.2) or, per datum, from
``loss_fn_inputs`` of the same names.

``stable_reinforce`` — Tinker names this loss but does not publish its objective, so the numerics
here are OpenTinker's own: a REINFORCE whose importance weight is truncated and taken per sampled
*sequence*. Its inputs come from the server, which resolves a datum's provenance spans against
what the sampler recorded (``service/stability.py``), never from the client's own claims:
``stability_logprobs`` q (the logprob the sampler gave each sampled token), ``stability_mask`` m
(1 where the target is a sampled token, 0 on prompt/observation tokens) and
``stability_sequence`` (which recorded sequence each position came from; -1 where none). For each
sequence s with sampled positions S(s): the sequence's log importance ratio is the mean over S(s)
of ``sg(lp_t) - q_t`` (a geometric mean of the token ratios, so one noisy token cannot swing it),
its weight ``w_s = min(exp(that), c)`` with ``c`` = ``loss_fn_config["max_importance_weight"]``
(default 2.0): truncated importance sampling, so stale or numerically different samples are
down-weighted but never amplified past ``c``. Each sampled token t of s then contributes
``-w_s · A_t · lp_t`` (its REINFORCE gradient ``-w_s · A_t · ∇lp_t``); other positions contribute 0.
The client's ``logprobs`` input, if sent, is accepted and ignored.
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


def stable_reinforce(lp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    q, mask = inputs["stability_logprobs"], inputs["stability_mask"]
    seq = inputs["stability_sequence"]
    weight = torch.zeros_like(lp)
    for s in torch.unique(seq[mask != 0]).tolist():  # each sequence of the datum: its own weight
        at = (seq == s) & (mask != 0)
        log_ratio = (lp.detach() - q)[at].mean()
        weight = torch.where(at, torch.exp(log_ratio).clamp(max=config["max_importance_weight"]), weight)
    return -(mask * weight * inputs["advantages"] * lp)


_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_CLIP_INPUTS = ("clip_low_threshold", "clip_high_threshold")
_RL = ("target_tokens", "logprobs", "advantages")
# what the server resolves from provenance spans and its sampling records (service/stability.py)
STABILITY_INPUTS = ("stability_logprobs", "stability_mask", "stability_sequence")

LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ("target_tokens",), ("weights",), {}),
    "importance_sampling": LossSpec(importance_sampling, _RL, (), {}),
    "ppo": LossSpec(ppo, _RL, _CLIP_INPUTS, dict(_CLIP)),
    "cispo": LossSpec(cispo, _RL, _CLIP_INPUTS, dict(_CLIP)),
    "dro": LossSpec(dro, _RL, (), {"beta": 0.05}),
    "gspo": LossSpec(gspo, _RL, ("sequence_ratio_mask", *_CLIP_INPUTS), dict(_CLIP)),
    "stable_reinforce": LossSpec(
        stable_reinforce,
        ("target_tokens", "advantages", *STABILITY_INPUTS),
        ("logprobs",),
        {"max_importance_weight": 2.0},
    ),
}


def resolve_config(loss_fn: str, config: dict[str, float]) -> dict[str, float]:
    """The loss's config with defaults filled in (the caller has validated the keys)."""
    return {**LOSSES[loss_fn].config, **{k: float(v) for k, v in config.items()}}
