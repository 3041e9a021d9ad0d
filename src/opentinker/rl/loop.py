"""The RL loop: rollouts -> :func:`~opentinker.rl.train_step.train_step` (group-relative
advantages, one ``forward_backward`` + ``optim_step``) -> a sampling client of the new weights,
every step. Two loops share that step and everything around it (:class:`_RLRun`: evaluation,
logging, stopping; the run scaffold :func:`~opentinker.tracking.run.open_run`: the training
client, resume, checkpoints, the final save, the plot):

* **sync** (:func:`_sync_loop`): step *n* samples with the policy after *n* updates, then trains
  on that data.
* **async** (:func:`_async_loop`): rollouts for the next steps are sampled while the trainer
  trains. Step *s* is trained at policy version *s*; the producer samples it only once the current
  version is at least ``s - max_staleness``, so no batch is ever staler than the bound (0 =
  synchronous). The loss's importance ratio uses the sampler's logprobs, which corrects for the lag.

It uses only the Tinker client API (any ``ServiceClient``: embedded or the SDK against a server).
Several runs (adapters) train concurrently in one process with :func:`run_rl_many`: their
requests meet in the scheduler and share its fused batches. A failing sampler stops the run with
:class:`~opentinker.rl.rollout.SamplerError` (an environment's failures are only counted).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker import types

from opentinker.rl.advantages import group_advantages
from opentinker.rl.replay import SuccessReplay
from opentinker.rl.rollout import gather_or_cancel, group_metrics, rollout_group, write_failures
from opentinker.rl.train_step import train_step
from opentinker.rl.ttt import TTTConfig, TTTStats, TTTUpdates, fork_point, ttt_rollout_group
from opentinker.rl.types import Evaluator, RLDataset, TrajectoryGroup
from opentinker.tracking import RolloutLog
from opentinker.tracking.rollouts import DEFAULT_MAX_BYTES, DEFAULT_PER_STEP
from opentinker.tracking.run import Run, RunConfig, RunResult, check_at_least, open_run
from opentinker.tracking.schedule import schedule_factor

LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo")


@dataclass
class RLConfig(RunConfig):
    log_dir: str = "runs/rl"
    steps: int = 20
    train_mlp: bool = False
    # "constant", or "linear" / "cosine" decay to lr_final * learning_rate over the run's horizon:
    # `steps`, or `max_train_s` of training clock when that ends the run sooner.
    lr_schedule: str = "constant"
    plot_keys: tuple[str, ...] = ("reward/mean", "eval/accuracy", "loss/per_token")
    groups_per_step: int = 4
    group_size: int = 8
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
    merge_timelines: bool = True  # merge an episode's calls into timelines (rl/timeline.py)
    mode: str = "sync"  # or "async"
    max_staleness: int = 1
    eval_every: int = 10  # 0 = never (always at the start and the end when an evaluator is given)
    stop_when: tuple[str, float] | None = None  # e.g. ("eval/accuracy", 0.8): stop once reached
    max_train_s: float | None = None  # stop after this much wall clock, evaluations excluded
    episode_timeout_s: float | None = 60.0  # per env call (reset, step); sampling does not count
    # test-time training inside every training episode (rl/ttt.py); None = off
    ttt: TTTConfig | None = None
    rollouts_per_step: int = DEFAULT_PER_STEP  # episodes of each step kept in rollouts.jsonl (0 = none)
    rollouts_max_bytes: int = DEFAULT_MAX_BYTES  # rollouts.jsonl stops growing here

    def check(self) -> None:
        if self.loss_fn not in LOSSES:
            raise ValueError(f"loss_fn must be one of {LOSSES}, got {self.loss_fn!r}")
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', got {self.mode!r}")
        check_at_least(self, 1, "steps", "groups_per_step", "group_size", "max_tokens", "substeps")
        super().check()
        if not 0 <= self.lr_final <= 1:
            raise ValueError(f"lr_final must be in [0, 1], got {self.lr_final}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")


RLResult = RunResult  # the run scaffold's result, under this loop's name


class _RLRun:
    """One run's state and the parts of a step both loops share: sampling a step's rollouts,
    training on them (:meth:`train`), and the step's end (:meth:`end_step`: checkpoint, evaluation,
    log row, stopping rule)."""

    def __init__(
        self, cfg: RLConfig, dataset: RLDataset, evaluator: Evaluator | None, run: Run, service: Any,
        base_policy: Any | None, replay: SuccessReplay | None,
        on_step: Callable[[str, dict[str, Any]], None] | None,
    ) -> None:  # fmt: skip
        self.cfg, self.dataset, self.evaluator, self.run = cfg, dataset, evaluator, run
        self.tc, self.start, self.log_dir = run.tc, run.start, run.log_dir
        self.service, self.base_policy, self.replay = service, base_policy, replay
        self.on_step = on_step
        self.params = types.SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature)
        self.policy: Any = None  # the sampling client of the current weights, at `version`
        self.version = run.start
        self.refreshed = asyncio.Condition()  # notified when `version` moves on
        self.t_start = time.monotonic()
        self.eval_total = 0.0  # evaluation time, kept off the training clock
        self.pending_eval: dict[str, float] = {}  # the start's evaluation, logged with the first row
        self.ttt_metrics: dict[str, float] = {}  # the last rollouts' test-time updates
        self.ttt_updates: TTTUpdates | None = None  # every group's episodes fuse; forks are reused
        self.rollout_log = (
            RolloutLog(
                run.log_dir, self.tc.get_tokenizer(), series=run.name, per_step=cfg.rollouts_per_step,
                max_bytes=cfg.rollouts_max_bytes, start_step=run.start,
            )
            if cfg.rollouts_per_step > 0
            else None
        )  # fmt: skip

    def train_clock(self) -> float:
        return time.monotonic() - self.t_start - self.eval_total

    async def begin(self) -> None:
        self.policy = await self.tc.save_weights_and_get_sampling_client()
        self.t_start = time.monotonic()
        if self.evaluator is not None:
            self.pending_eval = await self.evaluate(self.policy, self.start)

    async def rollouts(self, step: int, policy: Any, version: int) -> list[TrajectoryGroup]:
        cfg = self.cfg
        seed = cfg.seed * 1_000_003 + step * 10_007
        if cfg.ttt is not None:  # every episode trains its own fork of the policy's weights
            assert self.service is not None
            path = await fork_point(self.tc, f"ttt-fork-{step:06d}")
            stats = TTTStats()
            if self.ttt_updates is None:
                self.ttt_updates = TTTUpdates(self.service, cfg.ttt)
            updates = self.ttt_updates
            groups = await gather_or_cancel(
                *(
                    ttt_rollout_group(b, policy, self.params, service=self.service, fork_path=path, cfg=cfg.ttt, seed=seed + 31 * k, timeout_s=cfg.episode_timeout_s, policy_version=version, stats=stats, updates=updates)
                    for k, b in enumerate(self.dataset.batch(step))
                )
            )  # fmt: skip
            self.ttt_metrics = stats.metrics()
            return groups
        return await gather_or_cancel(
            *(
                rollout_group(b, policy, self.params, seed=seed + 31 * k, timeout_s=cfg.episode_timeout_s, policy_version=version)
                for k, b in enumerate(self.dataset.batch(step))
            )
        )  # fmt: skip

    async def evaluate(self, policy: Any, step: int) -> dict[str, float]:
        assert self.evaluator is not None
        t = time.monotonic()
        out = {f"eval/{k}": v for k, v in (await self.evaluator(policy, step)).items()}
        out["time/eval_s"] = time.monotonic() - t
        self.eval_total += out["time/eval_s"]
        return out

    async def train(
        self, groups: list[TrajectoryGroup], step: int, sampled_at: int, t_sample: float
    ) -> dict[str, Any]:
        """Train on ``groups`` (sampled at policy version ``sampled_at``), then move the policy on."""
        t1 = time.monotonic()
        stale = self.version - sampled_at
        m: dict[str, Any] = {**group_metrics(groups), **self.ttt_metrics}
        write_failures(self.log_dir, step, groups)  # each lost episode's error, beside env/errors
        if self.rollout_log is not None:
            episodes = []
            for gi, g in enumerate(groups):
                advs = group_advantages([t.total_reward for t in g.trajectories])
                episodes += [(gi, t, a) for t, a in zip(g.trajectories, advs, strict=True)]
            self.rollout_log.log(step, episodes)
        if stale > self.cfg.max_staleness:  # the async producer's wait prevents it; kept as a guard
            m["train/dropped_stale"] = 1.0
        else:
            lr = learning_rate_at(self.cfg, step, self.train_clock())
            m.update(
                await train_step(
                    self.tc, groups, self.cfg, learning_rate=lr, step=step, base_policy=self.base_policy, replay=self.replay
                )
            )  # fmt: skip
            self.policy = await self.tc.save_weights_and_get_sampling_client()
            async with self.refreshed:
                self.version += 1
                self.refreshed.notify_all()
        m.update({
            "time/sample_s": t_sample, "time/train_s": time.monotonic() - t1,
            "policy/version": float(self.version), "policy/staleness": float(stale),
        })  # fmt: skip
        return m

    async def end_step(self, step: int, m: dict[str, Any]) -> bool:
        """Checkpoint, evaluate and log step ``step``; True when the run should stop here."""
        cfg = self.cfg
        await self.run.maybe_checkpoint(step + 1)
        if self.evaluator is not None and (
            step + 1 == cfg.steps or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)
        ):
            m.update(await self.evaluate(self.policy, step + 1))
        m["time/train_clock_s"] = self.train_clock()  # wall clock minus evaluations
        row = self.run.log(step, {**self.pending_eval, **m})
        if self.on_step is not None:
            self.on_step(self.run.name, row)
        self.pending_eval = {}
        return _should_stop(cfg, m)


async def _sync_loop(run: _RLRun) -> None:
    """Each step samples with the current policy, then trains on what it sampled."""
    for step in range(run.start, run.cfg.steps):
        t0 = time.monotonic()
        groups = await run.rollouts(step, run.policy, run.version)
        m = await run.train(groups, step, run.version, time.monotonic() - t0)
        if await run.end_step(step, m):
            break


async def _async_loop(run: _RLRun) -> None:
    """A producer samples ahead (step ``s`` from a policy of version >= ``s - max_staleness``)
    while this loop trains on what it produced, in step order."""
    cfg = run.cfg
    queue: asyncio.Queue[tuple[list[TrajectoryGroup], int, float]] = asyncio.Queue(
        maxsize=max(1, cfg.max_staleness)
    )

    async def producer() -> None:
        for step in range(run.start, cfg.steps):
            async with run.refreshed:  # step is trained at version `step`: sample it from >= step - bound
                await run.refreshed.wait_for(lambda s=step: run.version >= s - cfg.max_staleness)
            pol, ver = run.policy, run.version
            t0 = time.monotonic()
            groups = await run.rollouts(step, pol, ver)
            await queue.put((groups, ver, time.monotonic() - t0))

    prod = asyncio.create_task(producer())
    try:
        for step in range(run.start, cfg.steps):
            groups, ver, t_sample = await _next_batch(queue, prod)
            m = await run.train(groups, step, ver, t_sample)
            if await run.end_step(step, m):
                break
    finally:
        prod.cancel()


async def _next_batch(queue: asyncio.Queue, prod: asyncio.Task) -> Any:
    """The producer's next batch; the producer's own failure (e.g. a dead sampler) if it died."""
    get = asyncio.ensure_future(queue.get())
    await asyncio.wait({get, prod}, return_when=asyncio.FIRST_COMPLETED)
    if not get.done():
        if prod.exception() is not None:  # (a cancelled producer raises CancelledError here)
            get.cancel()
            raise prod.exception()  # type: ignore[misc]
        await get  # it finished: its last batch is in the queue
    return get.result()


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
    """Train one adapter with RL; write ``cfg.log_dir/{config.json, metrics.jsonl, curves.png}``
    (the run scaffold, :func:`~opentinker.tracking.run.open_run`: resume, checkpoints, final save)."""
    cfg.check()
    log_dir = Path(cfg.log_dir)
    replay = (
        SuccessReplay(cfg.replay_size, cfg.replay_per_step, cfg.replay_weight, cfg.seed)
        if cfg.replay_size
        else None
    )
    if replay is not None and resume:
        replay.load(log_dir / "replay.json")
    on_save = None if replay is None else (lambda _step: replay.save(log_dir / "replay.json"))
    async with open_run(
        cfg, service, total_steps=cfg.steps, show=("reward/mean", "eval/accuracy", "loss/per_token"),
        resume=resume, training_client=training_client, on_save=on_save,
    ) as run:  # fmt: skip
        base_policy = service.create_sampling_client(base_model=cfg.base_model) if cfg.kl_coef > 0 else None
        loop = _RLRun(cfg, dataset, evaluator, run, service, base_policy, replay, on_step)
        try:
            await loop.begin()
            await (_async_loop(loop) if cfg.mode == "async" else _sync_loop(loop))
        finally:
            if loop.ttt_updates is not None:
                await loop.ttt_updates.close()  # the pooled episodes' adapters
    return RLResult.of(run)


def learning_rate_at(cfg: RLConfig, step: int, train_clock_s: float) -> float:
    """The learning rate of ``step``: ``cfg.lr_schedule`` over the run's progress in [0, 1] (steps
    done of ``cfg.steps``, or training clock spent of ``cfg.max_train_s`` if that is further on)."""
    if cfg.lr_schedule == "constant":
        return cfg.learning_rate
    progress = step / cfg.steps
    if cfg.max_train_s:
        progress = max(progress, train_clock_s / cfg.max_train_s)
    return cfg.learning_rate * schedule_factor(cfg.lr_schedule, min(1.0, progress), cfg.lr_final)


def _should_stop(cfg: RLConfig, m: dict[str, Any]) -> bool:
    if cfg.stop_when is not None:
        key, target = cfg.stop_when
        if isinstance(m.get(key), float) and m[key] >= target:
            return True
    return cfg.max_train_s is not None and m["time/train_clock_s"] >= cfg.max_train_s


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
