"""Sampling inside the training scheduler's ticks: the serialized reference of P9 and P10.

The product's scheduler hands every sample to a sampling service that runs beside training (the
sampling loop's thread, or worker processes). The reference the overlap ratios compare with is
the former design, where a tick ran its fused forward/backward, its optimizer steps and then the
waiting samples, one after another. :class:`TickSampling` rebuilds that with the scheduler's own
``submit_call``: each request queues a call on its client's queue; the call that runs takes every
waiting request (up to ``max_rows`` sequences, oldest first) and decodes them as one
mixed-policy ``generate`` batch, inside the tick, so a sample and a training step never run at
the same time.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

from opentinker.sampling import SampleRequest, SamplingBackend
from opentinker.sampling.loop import SampleCancelled
from opentinker.scheduler import Scheduler


class TickSampling:
    """A sampling service whose batches run inside ``scheduler``'s ticks (module docstring)."""

    def __init__(self, scheduler: Scheduler, backend: SamplingBackend, *, max_rows: int = 256) -> None:
        self.scheduler, self.backend, self.max_rows = scheduler, backend, max_rows
        self._waiting: deque[tuple[int, SampleRequest, Future]] = deque()
        self._lock = threading.Lock()
        self._ids = 0

    def submit(self, req: SampleRequest) -> Future:
        fut: Future = Future()
        with self._lock:
            self._ids += 1
            self._waiting.append((self._ids, req, fut))
        client = "" if req.policy is None else req.policy.partition("@")[0]
        self.scheduler.submit_call(client, self._batch)
        return fut

    def _batch(self, _trainer: Any) -> None:
        """One tick's samples: every waiting request that fits, as one batch."""
        take: list[tuple[int, SampleRequest, Future]] = []
        rows = 0
        with self._lock:
            while self._waiting and (not take or rows + self._waiting[0][1].num_samples <= self.max_rows):
                take.append(self._waiting.popleft())
                rows += take[-1][1].num_samples
        if not take:
            return
        try:
            outs: list[Any] = self.backend.generate([r for _, r, _ in take])
        except Exception as e:  # fails the batch's requests, never the scheduler
            outs = [e] * len(take)
        for (_, _, fut), out in zip(take, outs, strict=True):
            if isinstance(out, BaseException):
                fut.set_exception(out)
            else:
                fut.set_result(out)

    def last_request(self) -> int:
        return self._ids

    def state(self, rid: int) -> str:
        with self._lock:
            return "queued" if any(r == rid for r, _, _ in self._waiting) else "taken"

    def cancel(self, rid: int) -> bool:
        with self._lock:
            item = next((it for it in self._waiting if it[0] == rid), None)
            if item is None:
                return False
            self._waiting.remove(item)
        item[2].set_exception(SampleCancelled(f"sample request {rid} was cancelled before it ran"))
        return True

    def abort(self, rid: int) -> bool:
        return self.cancel(rid)

    def follow(self, group: str, policy_id: str) -> None:
        """Nothing: a batch runs to completion on the weights it started with."""

    def shutdown(self) -> None:
        with self._lock:
            left = list(self._waiting)
            self._waiting.clear()
        for _, _, fut in left:
            fut.set_exception(RuntimeError("the in-tick sampler was shut down"))


def serialize(scheduler: Scheduler, backend: SamplingBackend) -> None:
    """Make ``scheduler`` sample inside its ticks from now on (its sampling service stopped)."""
    if scheduler.rollout is not None:
        scheduler.rollout.shutdown()
    scheduler.rollout = TickSampling(scheduler, backend)
