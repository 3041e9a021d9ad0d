"""Metric sinks beside ``metrics.jsonl``: TensorBoard event files and W&B (offline by default),
with the same keys and steps. Both libraries are imported only when a sink is turned on, so the
rest of the package runs without them.

- TensorBoard: ``log_dir/tensorboard/`` (``tensorboard --logdir log_dir/tensorboard``), written
  with ``torch.utils.tensorboard.SummaryWriter`` (which needs the ``tensorboard`` package).
- W&B: ``wandb.init(mode=WANDB_MODE or "offline", dir=log_dir)``; ``wandb sync log_dir/wandb/…``
  uploads an offline run later.

:func:`set_default_sinks` turns sinks on for every :class:`~opentinker.tracking.RunLogger` made
afterwards (what ``opentinker train --tensorboard --wandb`` does).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

_defaults = {"tensorboard": False, "wandb": False}


def set_default_sinks(*, tensorboard: bool = False, wandb: bool = False) -> None:
    _defaults.update(tensorboard=tensorboard, wandb=wandb)


def default_sinks() -> dict[str, bool]:
    return dict(_defaults)


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise RuntimeError("--tensorboard needs the tensorboard package (pip install tensorboard)") from e
        self.dir = log_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.dir))

    def log(self, step: int, row: dict[str, Any]) -> None:
        for k, v in _scalars(row).items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, log_dir: Path, config: Any, name: str) -> None:
        try:
            import wandb  # pyright: ignore[reportMissingImports]
        except ImportError as e:
            raise RuntimeError("--wandb needs the wandb package (pip install wandb)") from e
        self.wandb = wandb
        mode = os.environ.get("WANDB_MODE", "offline")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "opentinker"),
            name=name or log_dir.name,
            dir=str(log_dir),
            mode=mode,  # type: ignore[arg-type]
            config=config if isinstance(config, dict) else None,
            reinit="create_new",
        )

    def log(self, step: int, row: dict[str, Any]) -> None:
        self.run.log(_scalars(row), step=step)

    def close(self) -> None:
        self.run.finish()
