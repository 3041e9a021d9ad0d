"""The server's own record of each training run's progress, for the console: loss per
``forward_backward``, grad norm and learning rate per ``optim_step``, as their results reported
them.

Kept in memory, bounded per model (:data:`MAX_POINTS`, the oldest dropped first). A restarted
server starts them afresh; checkpoints and their lineage live in the store. Each request's timing
(queue wait, tick, duration) is recorded once, by :mod:`opentinker.server.traces`.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

MAX_POINTS = 100_000  # per model and metric


@dataclass
class RunHistory:
    steps: int = 0  # optim steps taken
    loss: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=MAX_POINTS))
    grad_norm: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=MAX_POINTS))
    learning_rate: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=MAX_POINTS))


class History:
    def __init__(self) -> None:
        self._runs: dict[str, RunHistory] = {}
        self._lock = threading.Lock()

    def _run(self, model_id: str) -> RunHistory:
        run = self._runs.get(model_id)
        if run is None:
            run = self._runs[model_id] = RunHistory()
        return run

    def forward(self, model_id: str, metrics: dict[str, Any]) -> None:
        loss = metrics.get("loss:sum")
        if isinstance(loss, int | float):
            with self._lock:
                run = self._run(model_id)
                run.loss.append((run.steps, float(loss)))

    def optim(self, model_id: str, metrics: dict[str, Any]) -> None:
        with self._lock:
            run = self._run(model_id)
            run.steps += 1
            for key, series in (("grad_norm:mean", run.grad_norm), ("learning_rate:mean", run.learning_rate)):
                v = metrics.get(key)
                if isinstance(v, int | float):
                    series.append((run.steps, float(v)))

    def run(self, model_id: str) -> RunHistory | None:
        with self._lock:
            run = self._runs.get(model_id)
            if run is None:
                return None
            return RunHistory(run.steps, deque(run.loss), deque(run.grad_norm), deque(run.learning_rate))

    def steps(self, model_id: str) -> int:
        with self._lock:
            run = self._runs.get(model_id)
            return 0 if run is None else run.steps
