"""Trajectories -> training datums: advantages (and the sampler's logprobs) on the action tokens,
0 on everything the policy did not generate (context, environment observations).

An episode's calls are merged into timelines (rl/timeline.py): a call whose context extends an
earlier call's context + output joins that call's sequence, so a multi-turn episode whose every
observation extends the previous observation + action is one datum (its environment replies are
context, weight 0); a call whose context was rewritten starts a new datum. :func:`build_datums` is the step's whole datum
path: group-relative advantages (constant groups dropped on request), optional KL shaping to the
base model, datums.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from tinker import types

from opentinker.data import datum_from_tokens
from opentinker.rl.advantages import group_advantages, is_constant
from opentinker.rl.timeline import merge_timelines
from opentinker.rl.types import Trajectory, TrajectoryGroup

Segment = tuple[list[int], list[float], list[bool]]  # (tokens_T, sampler logprobs_T, is_action_T)


class DatumConfig(Protocol):
    """What :func:`build_datums` reads of a run's config (``RLConfig`` has it)."""

    drop_constant_groups: bool
    normalize_std: bool
    kl_coef: float
    merge_timelines: bool


def trajectory_segments(traj: Trajectory) -> list[Segment]:
    """The trajectory's calls merged into full sequences (:func:`~opentinker.rl.timeline.merge_timelines`:
    a call whose context extends an earlier call's context + output joins that call's sequence; a
    context that claims to extend one but does not raises ``TimelineError``). Each segment:
    (tokens_T, sampler logprob per token, is-action per token)."""
    return [(tl.tokens_T, tl.logprobs_T, tl.is_action_T) for tl in merge_timelines(traj.transitions)]


def per_call_segments(traj: Trajectory) -> list[Segment]:
    """The reference without merging: each call's context + output its own sequence."""
    return [
        (list(t.ob_T) + list(t.ac_T), [0.0] * len(t.ob_T) + list(t.logprobs_T),
         [False] * len(t.ob_T) + [True] * len(t.ac_T))
        for t in traj.transitions
    ]  # fmt: skip


def rl_datums(
    traj: Trajectory,
    advantage: float,
    token_advantages: list[list[float]] | None = None,
    *,
    merge: bool = True,
) -> list[types.Datum]:
    """RL: advantages on the action tokens (``advantage``, plus per-token shaping such as a KL
    penalty or per-call advantages in ``token_advantages``, one list per segment), sampler
    ``logprobs`` on them, 0 on everything else. ``merge=False``: one datum per call (the
    unmerged reference, :func:`per_call_segments`)."""
    out = []
    segs = trajectory_segments(traj) if merge else per_call_segments(traj)
    for k, (tokens_T, logprobs_T, is_action_T) in enumerate(segs):
        extra_T = token_advantages[k] if token_advantages is not None else [0.0] * len(tokens_T)
        adv_T = [(advantage + e) if a else 0.0 for a, e in zip(is_action_T, extra_T, strict=True)]
        lp_T = [lp if a else 0.0 for lp, a in zip(logprobs_T, is_action_T, strict=True)]
        out.append(datum_from_tokens(tokens_T, advantages=adv_T, logprobs=lp_T))
    return out


async def build_datums(
    groups: list[TrajectoryGroup], cfg: DatumConfig, base_policy: Any | None
) -> tuple[list[types.Datum], dict[str, float]]:
    """Advantages per group (constant groups dropped on request), optional KL shaping, datums."""
    datums: list[types.Datum] = []
    kept = dropped = 0
    constant_rewards: list[float] = []  # the reward of each dropped (constant) group
    kls: list[float] = []
    chosen: list[tuple[Trajectory, float]] = []  # (trajectory, advantage) of every kept group
    for g in groups:
        rewards_G = g.rewards_G
        if len(rewards_G) == 0:
            continue
        if cfg.drop_constant_groups and is_constant(rewards_G):
            dropped += 1
            constant_rewards.append(rewards_G[0])
            continue
        kept += 1
        advantages_G = group_advantages(rewards_G, normalize_std=cfg.normalize_std)
        chosen += list(zip(g.trajectories, advantages_G, strict=True))
    segments = trajectory_segments if cfg.merge_timelines else per_call_segments
    base_lps: list[list[list[float | None]]] = []
    if cfg.kl_coef > 0 and base_policy is not None and chosen:
        # every segment's base logprobs in one go: they share one sampler batch
        segs = [[tokens_T for tokens_T, _, _ in segments(t)] for t, _ in chosen]
        flat = await asyncio.gather(
            *(
                _awaited(base_policy.compute_logprobs(types.ModelInput.from_ints(s)))
                for ss in segs
                for s in ss
            )
        )
        it = iter(flat)
        base_lps = [[next(it) for _ in ss] for ss in segs]
    for k, (traj, a) in enumerate(chosen):
        shaping = None
        if base_lps:
            shaping = []
            for (_, lp_T, is_action_T), base_lp_T in zip(segments(traj), base_lps[k], strict=True):
                seg = []
                for i, (is_act, blp) in enumerate(zip(is_action_T, base_lp_T, strict=True)):
                    if is_act and i > 0 and blp is not None:
                        kl = lp_T[i] - float(blp)
                        kls.append(kl)
                        seg.append(-cfg.kl_coef * kl)
                    else:
                        seg.append(0.0)
                shaping.append(seg)
        datums += rl_datums(traj, a, shaping, merge=cfg.merge_timelines)
    n_tok = sum(t.num_action_tokens for g in groups for t in g.trajectories) if datums else 0
    m = {
        "groups/kept": float(kept),
        "groups/dropped_constant": float(dropped),
        "train/action_tokens": float(n_tok),
        "train/calls": float(sum(len(t.transitions) for t, _ in chosen)),
        "train/tokens": float(sum(d.model_input.length + 1 for d in datums)),
    }
    if chosen:  # the advantage scale the loss sees
        m["advantage/abs_mean"] = sum(abs(a) for _, a in chosen) / len(chosen)
    if constant_rewards:  # with 0/1 rewards: the share of constant groups that were all solved
        m["groups/constant_reward_mean"] = sum(constant_rewards) / len(constant_rewards)
    if kls:
        m["kl/sampler_vs_base"] = sum(kls) / len(kls)
    return datums, m


async def _awaited(fut: Any) -> Any:
    """A client future (ours or the SDK's: awaitable, not an asyncio future) as a coroutine."""
    return await fut
