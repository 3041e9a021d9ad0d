"""One run's log folder: the config it ran with, one JSON line of metrics per step, a progress bar."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from opentinker.tracking.sinks import TensorBoardSink, WandbSink, default_sinks


def _jsonable(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {k: _jsonable(x) for k, x in dataclasses.asdict(v).items()}
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, str | int | float | bool) or v is None:
        return v
    return repr(v)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    p = p / "metrics.jsonl" if p.is_dir() else p
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


class RunLogger:
    """Writes ``log_dir/config.json`` once and appends ``log_dir/metrics.jsonl`` per step.

    ``show`` names the metrics the progress bar displays. On resume (``append=True``) lines for
    steps at or after the resume step are dropped first, so the file stays one line per step."""

    def __init__(
        self,
        log_dir: str | Path,
        config: Any,
        *,
        total_steps: int | None = None,
        show: tuple[str, ...] = (),
        progress: bool = True,
        start_step: int = 0,
        name: str = "",
        tensorboard: bool | None = None,
        wandb: bool | None = None,
    ) -> None:
        """``tensorboard`` / ``wandb``: also write each row to those sinks (None: the process
        default, :func:`~opentinker.tracking.sinks.set_default_sinks`)."""
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.json").write_text(json.dumps(_jsonable(config), indent=2) + "\n")
        self.path = self.dir / "metrics.jsonl"
        kept = (
            [m for m in read_metrics(self.path) if m.get("step", -1) < start_step]
            if self.path.exists()
            else []
        )
        self.path.write_text("".join(json.dumps(m) + "\n" for m in kept))
        self.show = show
        self.t0 = time.monotonic()
        on = default_sinks()
        self.sinks: list[Any] = []
        if tensorboard if tensorboard is not None else on["tensorboard"]:
            self.sinks.append(TensorBoardSink(self.dir))
        if wandb if wandb is not None else on["wandb"]:
            self.sinks.append(WandbSink(self.dir, _jsonable(config), name))
        self.bar = (
            tqdm(
                total=total_steps,
                initial=start_step,
                desc=name or self.dir.name,
                file=sys.stderr,
                dynamic_ncols=True,
            )
            if progress
            else None
        )

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        row = {"step": step, "time/elapsed_s": round(time.monotonic() - self.t0, 3), **_jsonable(metrics)}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for sink in self.sinks:
            sink.log(step, row)
        if self.bar is not None:
            shown = {k.split("/")[-1]: row[k] for k in self.show if isinstance(row.get(k), int | float)}
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
            self.bar.update(1)
        return row

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        if self.bar is not None:
            self.bar.close()
