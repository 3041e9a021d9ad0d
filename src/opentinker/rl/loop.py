"""The RL loop: rollouts -> group-relative advantages -> one ``forward_backward`` + ``optim_step``
per step, with the policy version refreshed every step.

It uses only the Tinker client API (any ``ServiceClient``: embedded or the SDK against a server).

* **sync** mode: step *n* samples with the policy after *n* updates, then trains on that data.
* **async** mode: rollouts for the next steps are sampled while the trainer trains. Step *s* is
  trained at policy version *s*; the producer samples it only once the current version is at
  least ``s - max_staleness``, so no batch is ever staler than the bound (0 = synchronous). The
  loss's importance ratio uses the sampler's logprobs, which corrects for the lag.

Several runs (adapters) train concurrently in one process with :func:`run_rl_many`: their
requests meet in the scheduler and share its fused batches.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker import types

from opentinker.data import rl_datums, trajectory_segments
from opentinker.rl.advantages import group_advantages, is_constant
from opentinker.rl.env import RLDataset
from opentinker.rl.replay import SuccessReplay
from opentinker.rl.rollout import TrajectoryGroup, rollout_group
from opentinker.tracking import RunLogger, plot_metrics
from opentinker.tracking.checkpoints import open_training_client, save_checkpoint

log = logging.getLogger(__name__)

LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo")
Evaluator = Callable[[Any, int], Awaitable[dict[str, float]]]  # (sampling client, step) -> metrics


LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class RLConfig:
    base_model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    log_dir: str = "runs/rl"
    steps: int = 20
    groups_per_step: int = 4
    group_size: int = 8
    lora_rank: int = 8
    train_attn: bool = True
    train_mlp: bool = False
    train_unembed: bool = False
    learning_rate: float = 1e-4
    # "constant", or "linear" / "cosine" decay to lr_final * learning_rate over the run's horizon:
    # `steps`, or `max_train_s` of training clock when that ends the run sooner.
    lr_schedule: str = "constant"
    lr_final: float = 0.1
    substeps: int = 1  # optimizer steps per batch of rollouts (each a forward_backward + optim_step)
    # A batch with no signal (every group constant) still takes an optimizer step with zero
    # gradient, as trainers that always step do: AdamW's momentum carries the last signal on.
    step_on_empty: bool = True
    # Success replay (rl/replay.py): keep up to replay_size best-of-group successes, and add
    # replay_per_step of them to each step as cross-entropy datums of weight replay_weight.
    replay_size: int = 0
    replay_per_step: int = 4
    replay_weight: float = 1.0
    loss_fn: str = "importance_sampling"
    loss_fn_config: dict[str, float] | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    normalize_std: bool = False
    drop_constant_groups: bool = True
    kl_coef: float = 0.0  # KL penalty to the base model (per action token), via compute_logprobs
    mode: str = "sync"  # or "async"
    max_staleness: int = 1
    eval_every: int = 10  # 0 = never (always at the start and the end when an evaluator is given)
    save_every: int = 0  # save_state every n steps (0 = only at the end)
    stop_when: tuple[str, float] | None = None  # e.g. ("eval/accuracy", 0.8): stop once reached
    max_train_s: float | None = None  # stop after this much wall clock, evaluations excluded
    seed: int = 0
    episode_timeout_s: float | None = 60.0  # per env call (reset, step); sampling does not count
    progress: bool = True
    plot_keys: tuple[str, ...] = ("reward/mean", "eval/accuracy", "loss/per_token")
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        if self.loss_fn not in LOSSES:
            raise ValueError(f"loss_fn must be one of {LOSSES}, got {self.loss_fn!r}")
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', got {self.mode!r}")
        for k in ("steps", "groups_per_step", "group_size", "lora_rank", "max_tokens", "substeps"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be a positive number, got {self.learning_rate}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if not 0 <= self.lr_final <= 1:
            raise ValueError(f"lr_final must be in [0, 1], got {self.lr_final}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")


@dataclass
class RLResult:
    training_client: Any
    metrics: list[dict[str, Any]]
    final_path: str | None


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def group_metrics(groups: list[TrajectoryGroup]) -> dict[str, float]:
    trajs = [t for g in groups for t in g.trajectories]
    m: dict[str, float] = {
        "reward/mean": _mean([t.total_reward for t in trajs]),
        "env/episodes": float(len(trajs)),
        "env/errors": float(sum(g.errors for g in groups)),
        "tokens/action_mean": _mean([float(t.num_action_tokens) for t in trajs]),
        "env/turns_mean": _mean([float(len(t.transitions)) for t in trajs]),
    }
    keys = {k for t in trajs for tr in t.transitions for k in tr.metrics}
    for k in sorted(keys):
        vals = [float(tr.metrics[k]) for t in trajs for tr in t.transitions if k in tr.metrics]
        m[f"env/{k}"] = _mean(vals)
    return m


async def build_datums(
    groups: list[TrajectoryGroup], cfg: RLConfig, base_policy: Any | None
) -> tuple[list[types.Datum], dict[str, float]]:
    """Advantages per group (constant groups dropped on request), optional KL shaping, datums."""
    datums: list[types.Datum] = []
    kept = dropped = 0
    kls: list[float] = []
    chosen: list[tuple[Any, float]] = []  # (trajectory, advantage) of every kept group
    for g in groups:
        rewards = g.rewards
        if len(rewards) == 0:
            continue
        if cfg.drop_constant_groups and is_constant(rewards):
            dropped += 1
            continue
        kept += 1
        advs = group_advantages(rewards, normalize_std=cfg.normalize_std)
        chosen += list(zip(g.trajectories, advs, strict=True))
    base_lps: list[list[list[float | None]]] = []
    if cfg.kl_coef > 0 and base_policy is not None and chosen:
        # every segment's base logprobs in one go: they share one sampler batch
        segs = [[tokens for tokens, _, _ in trajectory_segments(t)] for t, _ in chosen]
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
            for (_, lps, act), base_lp in zip(trajectory_segments(traj), base_lps[k], strict=True):
                seg = []
                for i, (is_act, blp) in enumerate(zip(act, base_lp, strict=True)):
                    if is_act and i > 0 and blp is not None:
                        kl = lps[i] - float(blp)
                        kls.append(kl)
                        seg.append(-cfg.kl_coef * kl)
                    else:
                        seg.append(0.0)
                shaping.append(seg)
        datums += rl_datums(traj, a, shaping)
    n_tok = sum(t.num_action_tokens for g in groups for t in g.trajectories) if datums else 0
    m = {
        "groups/kept": float(kept),
        "groups/dropped_constant": float(dropped),
        "train/action_tokens": float(n_tok),
    }
    if kls:
        m["kl/sampler_vs_base"] = _mean(kls)
    return datums, m


async def run_rl(
    cfg: RLConfig,
    service: Any,
    dataset: RLDataset,
    evaluator: Evaluator | None = None,
    *,
    training_client: Any | None = None,
    resume: bool = False,
    on_step: Callable[[str, dict[str, Any]], None] | None = None,
) -> RLResult:
    """Train one adapter with RL; write ``cfg.log_dir/{config.json, metrics.jsonl, curves.png}``."""
    cfg.check()
    log_dir = Path(cfg.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    tc, start = await open_training_client(
        service, cfg, log_dir, resume=resume, training_client=training_client
    )
    base_policy = service.create_sampling_client(base_model=cfg.base_model) if cfg.kl_coef > 0 else None
    logger = RunLogger(
        log_dir, cfg, total_steps=cfg.steps, start_step=start, progress=cfg.progress, name=cfg.name,
        show=("reward/mean", "eval/accuracy", "loss/per_token"),
    )  # fmt: skip
    params = types.SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature)
    rows: list[dict[str, Any]] = []
    final_path: str | None = None

    async def rollouts(step: int, policy: Any, version: int) -> list[TrajectoryGroup]:
        builders = dataset.batch(step)
        seed = cfg.seed * 1_000_003 + step * 10_007
        return list(
            await asyncio.gather(
                *(
                    rollout_group(b, policy, params, seed=seed + 31 * k, timeout_s=cfg.episode_timeout_s, policy_version=version)
                    for k, b in enumerate(builders)
                )
            )
        )  # fmt: skip

    async def evaluate(policy: Any, step: int) -> dict[str, float]:
        if evaluator is None:
            return {}
        t = time.monotonic()
        out = {f"eval/{k}": v for k, v in (await evaluator(policy, step)).items()}
        out["time/eval_s"] = time.monotonic() - t
        return out

    replay = (
        SuccessReplay(cfg.replay_size, cfg.replay_per_step, cfg.replay_weight, cfg.seed)
        if cfg.replay_size
        else None
    )
    if replay is not None and resume:
        replay.load(log_dir / "replay.json")

    async def train_on(groups: list[TrajectoryGroup], step: int) -> dict[str, float]:
        lr = learning_rate_at(cfg, step, time.monotonic() - t_start - eval_total)
        adam = types.AdamParams(learning_rate=lr)
        datums, m = await build_datums(groups, cfg, base_policy)
        m["train/lr"] = lr
        replayed = replay.datums(step) if replay is not None else []
        if replay is not None:
            m["replay/added"] = float(replay.add(groups))
            m["replay/size"] = float(len(replay.items))
        replay_fb = None
        if replayed:  # imitation of past successes rides in the same optimizer step
            replay_fb = tc.forward_backward(replayed, "cross_entropy")
            m["replay/datums"] = float(len(replayed))
        if not datums:
            if replayed or cfg.step_on_empty:  # with zero fresh gradient AdamW's momentum still moves
                await tc.optim_step(adam)
            if replay_fb is not None:
                await replay_fb
            return {**m, "train/datums": 0.0}
        # ``substeps`` passes over the same batch (PPO-style epochs): the sampler logprobs stay the
        # behaviour policy's, so the loss's ratio corrects for the updates already made.
        futs = []
        for _ in range(cfg.substeps):
            fb = tc.forward_backward(datums, cfg.loss_fn, cfg.loss_fn_config)
            futs.append((fb, tc.optim_step(adam)))
        outs = []
        for fb, opt in futs:
            outs.append(await fb)
            await opt
        if replay_fb is not None:
            await replay_fb
        loss = float(outs[0].metrics.get("loss:sum", float("nan")))
        per_tok = loss / max(1.0, m["train/action_tokens"])
        return {**m, "train/datums": float(len(datums)), "loss/sum": loss, "loss/per_token": per_tok}

    policy = await tc.save_weights_and_get_sampling_client()
    current: dict[str, Any] = {"policy": policy, "version": start}
    t_start = time.monotonic()
    eval_total = 0.0
    pending_eval = await evaluate(policy, start) if evaluator is not None else {}
    eval_total += float(pending_eval.get("time/eval_s", 0.0))
    queue: asyncio.Queue = asyncio.Queue(maxsize=max(1, cfg.max_staleness))
    prod: asyncio.Task | None = None

    refreshed = asyncio.Condition()

    async def producer() -> None:  # async mode: sampling runs ahead of training, boundedly
        for step in range(start, cfg.steps):
            async with refreshed:  # step is trained at version `step`: sample it from >= step - bound
                await refreshed.wait_for(lambda s=step: current["version"] >= s - cfg.max_staleness)
            pol, ver = current["policy"], current["version"]
            t0 = time.monotonic()
            groups = await rollouts(step, pol, ver)
            await queue.put((groups, ver, time.monotonic() - t0))

    async def next_batch(step: int) -> tuple[list[TrajectoryGroup], int, float]:
        if prod is not None:
            return await queue.get()
        t0 = time.monotonic()
        groups = await rollouts(step, current["policy"], current["version"])
        return groups, current["version"], time.monotonic() - t0

    last_step = start
    try:
        if cfg.mode == "async":
            prod = asyncio.create_task(producer())
        for step in range(start, cfg.steps):
            groups, ver, t_sample = await next_batch(step)
            stale = current["version"] - ver
            t1 = time.monotonic()
            m = group_metrics(groups)
            if stale > cfg.max_staleness:  # the producer's wait prevents it; kept as a guard
                m["train/dropped_stale"] = 1.0
            else:
                m.update(await train_on(groups, step))
                current["policy"] = await tc.save_weights_and_get_sampling_client()
                async with refreshed:
                    current["version"] += 1
                    refreshed.notify_all()
            m.update({
                "time/sample_s": t_sample, "time/train_s": time.monotonic() - t1,
                "policy/version": float(current["version"]), "policy/staleness": float(stale),
            })  # fmt: skip
            last_step = step + 1
            final_path = await _maybe_save(tc, cfg, step + 1, log_dir, final_path)
            if replay is not None and cfg.save_every and (step + 1) % cfg.save_every == 0:
                replay.save(log_dir / "replay.json")
            if evaluator is not None and (
                step + 1 == cfg.steps or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)
            ):
                ev = await evaluate(current["policy"], step + 1)
                eval_total += ev["time/eval_s"]
                m.update(ev)
            m["time/train_clock_s"] = time.monotonic() - t_start - eval_total  # wall clock minus evals
            rows.append(logger.log(step, {**pending_eval, **m}))
            if on_step is not None:
                on_step(cfg.name or log_dir.name, rows[-1])
            pending_eval = {}
            if _should_stop(cfg, m):
                break
        if prod is not None:
            prod.cancel()
        if cfg.save_every == 0 or last_step % cfg.save_every:
            final_path = await save_checkpoint(tc, last_step, log_dir)
            if replay is not None:
                replay.save(log_dir / "replay.json")
    finally:
        if prod is not None:
            prod.cancel()
        logger.close()
        if rows or (log_dir / "metrics.jsonl").exists():
            try:
                plot_metrics({cfg.name or log_dir.name: log_dir}, list(cfg.plot_keys), log_dir / "curves.png")
            except Exception as e:
                log.warning("plotting failed: %r", e)
    return RLResult(tc, rows, final_path)


def learning_rate_at(cfg: RLConfig, step: int, train_clock_s: float) -> float:
    """The learning rate of ``step``: ``cfg.lr_schedule`` over the run's progress in [0, 1] (steps
    done of ``cfg.steps``, or training clock spent of ``cfg.max_train_s`` if that is further on)."""
    if cfg.lr_schedule == "constant":
        return cfg.learning_rate
    progress = step / cfg.steps
    if cfg.max_train_s:
        progress = max(progress, train_clock_s / cfg.max_train_s)
    progress = min(1.0, progress)
    if cfg.lr_schedule == "linear":
        frac = 1.0 - (1.0 - cfg.lr_final) * progress
    else:  # cosine
        frac = cfg.lr_final + (1.0 - cfg.lr_final) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.learning_rate * frac


def _should_stop(cfg: RLConfig, m: dict[str, Any]) -> bool:
    if cfg.stop_when is not None:
        key, target = cfg.stop_when
        if isinstance(m.get(key), float) and m[key] >= target:
            return True
    return cfg.max_train_s is not None and m["time/train_clock_s"] >= cfg.max_train_s


async def _maybe_save(tc: Any, cfg: RLConfig, step: int, log_dir: Path, last: str | None) -> str | None:
    if cfg.save_every and step % cfg.save_every == 0:
        return await save_checkpoint(tc, step, log_dir)
    return last


def train_rl(
    cfg: RLConfig, service: Any, dataset: RLDataset, evaluator: Evaluator | None = None, **kw: Any
) -> RLResult:
    """Synchronous entry point for :func:`run_rl`."""
    return asyncio.run(run_rl(cfg, service, dataset, evaluator, **kw))


async def run_rl_many(
    jobs: list[tuple[RLConfig, RLDataset, Evaluator | None]],
    service: Any,
    on_step: Callable[[str, dict[str, Any]], None] | None = None,
) -> list[RLResult]:
    """Several RL runs (one adapter each) at once over one service: a multi-LoRA run."""
    return list(await asyncio.gather(*(run_rl(c, service, d, e, on_step=on_step) for c, d, e in jobs)))


async def _awaited(fut: Any) -> Any:
    """A client future (ours or the SDK's: awaitable, not an asyncio future) as a coroutine."""
    return await fut
