"""The server's own record of each training run's progress, for the console: loss per
``forward_backward``, grad norm and learning rate per ``optim_step``, and each request's timing
(the session trace).

Kept in memory, bounded per model (:data:`MAX_POINTS`, the oldest dropped first) and for the
trace per session (:data:`MAX_TRACE`). A restarted server starts them afresh; checkpoints and
their lineage live in the store.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

MAX_POINTS = 100_000  # per model and metric
MAX_TRACE = 10_000  # requests per session
MAX_SESSIONS = 10_000  # sessions with a trace kept


@dataclass
class RunHistory:
    steps: int = 0  # optim steps taken
    loss: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=MAX_POINTS))
    grad_norm: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=MAX_POINTS))
    learning_rate: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=MAX_POINTS))


class History:
    def __init__(self) -> None:
        self._runs: dict[str, RunHistory] = {}
        self._traces: dict[str, deque[dict[str, Any]]] = {}
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

    def request(self, session_id: str, kind: str, model_id: str | None, submitted: float) -> dict[str, Any]:
        """Start a trace entry of a request; :meth:`finished` completes it."""
        entry: dict[str, Any] = {"kind": kind, "model_id": model_id, "submitted": submitted}
        with self._lock:
            trace = self._traces.get(session_id)
            if trace is None:
                if len(self._traces) >= MAX_SESSIONS:
                    self._traces.pop(next(iter(self._traces)))
                trace = self._traces[session_id] = deque(maxlen=MAX_TRACE)
            trace.append(entry)
        return entry

    @staticmethod
    def finished(entry: dict[str, Any], *, tick: float | None, error: bool) -> None:
        entry["done"] = time.time()
        entry["duration_s"] = round(entry["done"] - entry["submitted"], 6)
        entry["tick"] = tick
        entry["error"] = error

    def trace(self, session_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(e) for e in self._traces.get(session_id, ())]
