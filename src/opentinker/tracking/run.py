"""The run scaffold every training loop shares: open, log, checkpoint cadence, resume, final save, plot.

::

    async with open_run(cfg, service, total_steps=n, resume=resume) as run:
        for step in range(run.start, n):
            ...                                  # train step `step` on run.tc
            await run.maybe_checkpoint(step + 1)  # steps done; saves every cfg.save_every
            run.log(step, metrics)
    return RunResult.of(run)

:func:`open_run` opens the run's training client (or one per agent): reloaded with its optimizer
from the newest checkpoint in ``log_dir/checkpoints.jsonl`` when resuming (``run.start`` is that
checkpoint's step), else fresh (``training_client`` / ``training_clients`` if given, else created).
It opens the :class:`~opentinker.tracking.RunLogger` (``config.json``, ``metrics.jsonl`` cut back
to ``run.start``, sinks, progress bar). On a clean exit the block's run gets its final save, and on
any exit the logger closes and ``curves.png`` is drawn.

**The final-save rule** (one for every loop): a run ends with a checkpoint at the last step it
reached (``steps done``: the run's end, or an earlier step where it stopped), saved unless the
newest checkpoint is already at that step (the cadence just saved it, or a resumed run had
nothing left to do). ``run.final_path`` / ``run.final_paths`` is then the newest checkpoint, from
the index when this session saved none.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentinker.tracking.checkpoints import SINGLE, open_training_clients, save_checkpoints
from opentinker.tracking.logger import RunLogger
from opentinker.tracking.plot import plot_metrics
from opentinker.tracking.schedule import check_schedule

log = logging.getLogger(__name__)


@dataclass
class RunConfig:
    """What every training loop's config holds (``RLConfig``, ``SFTConfig``, ``DPOConfig`` extend
    it, restating only the defaults they change): the adapter, the learning rate and its schedule,
    and what the scaffold reads. :meth:`check` refuses bad values of these fields, naming them."""

    base_model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    log_dir: str = "runs"
    steps: int = 0
    lora_rank: int = 8
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = False
    learning_rate: float = 1e-4
    lr_schedule: str = "linear"  # constant | linear | cosine
    save_every: int = 0  # save_state every n steps (0 = only the final save)
    seed: int = 0
    progress: bool = True
    plot_keys: tuple[str, ...] = ()
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        check_schedule(self.lr_schedule)
        if self.lora_rank < 1:
            raise ValueError(f"lora_rank must be >= 1, got {self.lora_rank}")
        if self.save_every < 0:
            raise ValueError(f"save_every must be >= 0, got {self.save_every}")
        check_positive(self, "learning_rate")


def check_at_least(cfg: object, low: int, *names: str) -> None:
    """Refuse fields of ``cfg`` below ``low``, naming the first."""
    for k in names:
        if getattr(cfg, k) < low:
            raise ValueError(f"{k} must be >= {low}, got {getattr(cfg, k)}")


def check_positive(cfg: object, *names: str) -> None:
    """Refuse fields of ``cfg`` that are not positive finite numbers, naming the first."""
    for k in names:
        v = getattr(cfg, k)
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{k} must be a positive number, got {v}")


class Run:
    """One open run: its training clients, log and checkpoints (made by :func:`open_run`)."""

    def __init__(
        self, cfg: RunConfig, clients: dict[str, Any], start: int, paths: dict[str, str], logger: RunLogger,
        *, plot: Callable[[Run], object] | None = None, on_save: Callable[[int], None] | None = None,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir)
        self.clients = clients  # agent -> training client (one-adapter run: the key is SINGLE)
        self.start = start  # the first step this session runs
        self.steps_done = start  # updates done so far (set by maybe_checkpoint)
        self.final_paths = dict(paths)  # the newest checkpoint: agent -> path
        self.saved_at: int | None = start if paths else None  # its step
        self.logger = logger
        self.rows: list[dict[str, Any]] = []  # this session's metrics rows
        self._plot = plot
        self._on_save = on_save

    @property
    def name(self) -> str:
        return self.cfg.name or self.log_dir.name

    @property
    def tc(self) -> Any:
        """The training client of a one-adapter run."""
        return self.clients[SINGLE]

    @property
    def final_path(self) -> str | None:
        """The newest checkpoint of a one-adapter run (None before any)."""
        return self.final_paths.get(SINGLE)

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Write ``step``'s metrics row (``metrics.jsonl``, sinks, progress bar) and keep it in ``rows``."""
        row = self.logger.log(step, metrics)
        self.rows.append(row)
        return row

    async def maybe_checkpoint(self, steps_done: int) -> None:
        """Record that ``steps_done`` updates are done; save if ``cfg.save_every`` divides it."""
        self.steps_done = steps_done
        if self.cfg.save_every and steps_done % self.cfg.save_every == 0:
            await self.save(steps_done)

    async def save(self, step: int) -> None:
        """Save every client's state at ``step`` to the index (then ``on_save(step)``)."""
        self.final_paths = await save_checkpoints(self.clients, step, self.log_dir)
        self.saved_at = step
        if self._on_save is not None:
            self._on_save(step)

    async def finish(self) -> None:
        """The final save (see the module docstring): at ``steps_done`` unless already saved there."""
        if self.saved_at != self.steps_done:
            await self.save(self.steps_done)

    def close(self) -> None:
        """Close the logger and draw ``curves.png`` (a failed plot is only logged)."""
        self.logger.close()
        if not self.logger.path.exists() or self.logger.path.stat().st_size == 0:
            return
        try:
            if self._plot is not None:
                self._plot(self)
            else:
                plot_metrics({self.name: self.log_dir}, list(self.cfg.plot_keys), self.log_dir / "curves.png")
        except Exception as e:
            log.warning("plotting failed: %r", e)


@dataclass
class RunResult:
    """What a finished one-adapter run gives back (RL, SFT, DPO): its training client, this
    session's metrics rows, and its newest checkpoint."""

    training_client: Any
    metrics: list[dict[str, Any]]
    final_path: str | None

    @classmethod
    def of(cls, run: Run) -> RunResult:
        return cls(run.tc, run.rows, run.final_path)


@asynccontextmanager
async def open_run(
    cfg: RunConfig,
    service: Any,
    *,
    total_steps: int | None,
    show: tuple[str, ...] = (),
    resume: bool = False,
    training_client: Any | None = None,
    agents: Sequence[str] | None = None,
    training_clients: Mapping[str, Any] | None = None,
    config: Any = None,
    plot: Callable[[Run], object] | None = None,
    on_save: Callable[[int], None] | None = None,
) -> AsyncIterator[Run]:
    """Open a run in ``cfg.log_dir`` (see the module docstring); the final save on a clean exit,
    the logger's close and the plot on any exit.

    ``agents``: one adapter per name (agent *k* created with seed ``cfg.seed + k``, or taken from
    ``training_clients``); else one adapter (``training_client`` if given). ``total_steps`` and
    ``show``: the progress bar's. ``config``: what ``config.json`` holds (default ``cfg``).
    ``plot(run)`` draws the curves instead of the default (``cfg.plot_keys`` from
    ``metrics.jsonl``). ``on_save(step)`` runs after each save (e.g. a loop's own extra state)."""
    log_dir = Path(cfg.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    if agents is None:
        names: tuple[str, ...] = (SINGLE,)
        given = None if training_client is None else {SINGLE: training_client}
    else:
        names, given = tuple(agents), training_clients
    clients, start, paths = await open_training_clients(
        service, cfg, log_dir, names, resume=resume, given=given
    )
    logger = RunLogger(
        log_dir, cfg if config is None else config, total_steps=total_steps, start_step=start,
        progress=cfg.progress, name=cfg.name, show=show,
    )  # fmt: skip
    run = Run(cfg, clients, start, paths, logger, plot=plot, on_save=on_save)
    try:
        yield run
        await run.finish()
    finally:
        run.close()
