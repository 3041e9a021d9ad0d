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

from collections import deque
from concurrent.futures import Future
from typing import Any

from opentinker.sampling import SampleRequest, SampleResult, SamplingBackend
from opentinker.sampling.decoder import Pinned
from opentinker.sampling.handles import RequestBook, SampleState
from opentinker.scheduler import ModelQueue, Scheduler


class TickSampling(RequestBook[Future]):
    """A sampling service whose batches run inside ``scheduler``'s ticks (module docstring)."""

    what = "the in-tick sampler"

    def __init__(self, scheduler: Scheduler, backend: SamplingBackend, *, max_rows: int = 256) -> None:
        super().__init__()
        self.scheduler, self.backend, self.max_rows = scheduler, backend, max_rows
        self._waiting: deque[tuple[int, SampleRequest]] = deque()

    def _pin(self, req: SampleRequest) -> Pinned:
        return Pinned(req, None)  # ``generate`` resolves the policy when the batch runs

    def _enqueue(self, rid: int, pinned: Pinned, future: Future[SampleResult]) -> Future:
        self._waiting.append((rid, pinned.req))
        return future

    def _woken(self) -> None:
        # one call per request on its client's queue, in that client's order with its training;
        # the first to run takes every waiting request, the later ones find fewer (or none)
        with self._lock:
            policy = self._waiting[-1][1].policy if self._waiting else None
        owner = "" if policy is None else policy.partition("@")[0]
        self.scheduler.submit_call(ModelQueue(owner), self._batch)

    @staticmethod
    def _future(entry: Future) -> Future:
        return entry

    def _where(self, rid: int) -> SampleState:
        return "queued" if any(r == rid for r, _ in self._waiting) else "taken"

    def _unqueue(self, rid: int) -> bool:
        item = next((it for it in self._waiting if it[0] == rid), None)
        if item is not None:
            self._waiting.remove(item)
        return item is not None

    def _stop(self, rid: int) -> None:
        """A batch runs to its end; the aborted request's answer is dropped."""

    def _batch(self, _trainer: Any) -> None:
        """One tick's samples: every waiting request that fits, as one batch."""
        take: list[tuple[int, SampleRequest]] = []
        rows = 0
        with self._lock:
            while self._waiting and (not take or rows + self._waiting[0][1].num_samples <= self.max_rows):
                take.append(self._waiting.popleft())
                rows += take[-1][1].num_samples
        if not take:
            return
        try:
            outs: list[Any] = self.backend.generate([r for _, r in take])
        except Exception as e:  # fails the batch's requests, never the scheduler
            outs = [e] * len(take)
        with self._lock:
            futs = [self._answered(rid) for rid, _ in take]
        for fut, out in zip(futs, outs, strict=True):
            if fut is None:  # aborted meanwhile
                continue
            if isinstance(out, BaseException):
                fut.set_exception(out)
            else:
                fut.set_result(out)

    def follow(self, group: str, policy_id: str) -> None:
        """Nothing: a batch runs to completion on the weights it started with."""

    def shutdown(self) -> None:
        with self._lock:
            left = self._close()
            self._waiting.clear()
        for fut in left:
            fut.set_exception(RuntimeError("the in-tick sampler was shut down"))


def serialize(scheduler: Scheduler, backend: SamplingBackend) -> None:
    """Make ``scheduler`` sample inside its ticks from now on (its sampling service stopped)."""
    if scheduler.rollout is not None:
        scheduler.rollout.shutdown()
    scheduler.rollout = TickSampling(scheduler, backend)
