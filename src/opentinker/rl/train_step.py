"""The RL update: a step's trajectory groups -> datums -> ``forward_backward`` + ``optim_step``
-> metrics. The sync and async loops (rl/loop.py) train one adapter through :func:`train_step`;
the multi-agent loop (rl/multiagent.py) trains every agent's adapter at once through
:func:`train_steps`, the same code.

Every request of the update is submitted before any is awaited (futures first): ``substeps``
passes over the batch (PPO-style epochs) queue up back to back, and several adapters' updates
(several agents) meet in the same scheduler ticks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from tinker import types

from opentinker.rl.datums import DatumConfig, build_datums
from opentinker.rl.replay import SuccessReplay
from opentinker.rl.types import TrajectoryGroup

# (groups, cfg) -> (datums, metrics): another advantage scheme (e.g. per-move advantages)
DatumsFn = Callable[[list[TrajectoryGroup], Any], tuple[list[types.Datum], dict[str, float]]]


class StepConfig(DatumConfig, Protocol):
    """What :func:`train_step` reads of a run's config (``RLConfig`` has it)."""

    loss_fn: str
    loss_fn_config: dict[str, float] | None
    substeps: int
    step_on_empty: bool


@dataclass
class Learner:
    """One adapter of an update: its training client, its groups of the step, its replay buffer."""

    tc: Any
    groups: list[TrajectoryGroup]
    replay: SuccessReplay | None = None


async def train_step(
    tc: Any,
    groups: list[TrajectoryGroup],
    cfg: StepConfig,
    *,
    learning_rate: float,
    step: int = 0,
    base_policy: Any | None = None,
    replay: SuccessReplay | None = None,
    datums_fn: DatumsFn | None = None,
) -> dict[str, float]:
    """Train ``tc`` (a ``TrainingClient``) on one step's groups and return the update's metrics;
    see :func:`train_steps`."""
    out = await train_steps(
        {"": Learner(tc, groups, replay)}, cfg, learning_rate=learning_rate, step=step,
        base_policy=base_policy, datums_fn=datums_fn,
    )  # fmt: skip
    return out[""]


async def train_steps(
    learners: Mapping[str, Learner],
    cfg: StepConfig,
    *,
    learning_rate: float,
    step: int = 0,
    base_policy: Any | None = None,
    datums_fn: DatumsFn | None = None,
) -> dict[str, dict[str, float]]:
    """One update of each learner (e.g. each agent of a game) at once; metrics by learner.

    Datums: group-relative advantages (:func:`~opentinker.rl.datums.build_datums`, with KL shaping
    to ``base_policy`` when ``cfg.kl_coef > 0``), or ``datums_fn``. With a replay buffer, its
    picks for ``step`` ride in the same optimizer step as cross-entropy datums, then the step's
    successes join it. A learner without datums still takes its optimizer step when
    ``cfg.step_on_empty`` (with zero fresh gradient AdamW's momentum carries the last signal on).
    Submission order: every replay ``forward_backward``; then per substep every learner's
    ``forward_backward``, then every learner's ``optim_step``; then the empty learners' steps.
    """
    adam = types.AdamParams(learning_rate=learning_rate)
    names = list(learners)
    if datums_fn is not None:
        built = [datums_fn(learners[n].groups, cfg) for n in names]
    else:
        built = list(
            await asyncio.gather(*(build_datums(learners[n].groups, cfg, base_policy) for n in names))
        )
    datums = {n: d for n, (d, _) in zip(names, built, strict=True)}
    metrics = {n: {**m, "train/lr": learning_rate} for n, (_, m) in zip(names, built, strict=True)}
    replay_fbs: dict[str, Any] = {}
    replayed: dict[str, bool] = {}
    for n in names:
        replay, m = learners[n].replay, metrics[n]
        picks = replay.datums(step) if replay is not None else []
        if replay is not None:
            m["replay/added"] = float(replay.add(learners[n].groups))
            m["replay/size"] = float(len(replay.items))
        replayed[n] = bool(picks)
        if picks:  # imitation of past successes rides in the same optimizer step
            replay_fbs[n] = learners[n].tc.forward_backward(picks, "cross_entropy")
            m["replay/datums"] = float(len(picks))
    # the sampler logprobs stay the behaviour policy's over the substeps, so the loss's importance
    # ratio corrects for the updates already made
    todo = [n for n in names if datums[n]]
    futs: dict[str, list[tuple[Any, Any]]] = {n: [] for n in todo}
    for _ in range(cfg.substeps):
        fbs = {n: learners[n].tc.forward_backward(datums[n], cfg.loss_fn, cfg.loss_fn_config) for n in todo}
        for n in todo:
            futs[n].append((fbs[n], learners[n].tc.optim_step(adam)))
    empty = [n for n in names if not datums[n] and (replayed[n] or cfg.step_on_empty)]
    empty_opts = [learners[n].tc.optim_step(adam) for n in empty]
    for n in todo:
        outs = []
        for fb, opt in futs[n]:
            outs.append(await fb)
            await opt
        m = metrics[n]
        loss = float(outs[0].metrics.get("loss:sum", float("nan")))
        m.update({"train/datums": float(len(datums[n])), "loss/sum": loss})
        m["loss/per_token"] = loss / max(1.0, m["train/action_tokens"])
    for opt in empty_opts:
        await opt
    for n in names:
        if n in replay_fbs:
            await replay_fbs[n]
        if not datums[n]:
            metrics[n]["train/datums"] = 0.0
    return metrics
