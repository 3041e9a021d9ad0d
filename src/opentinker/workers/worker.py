"""A rollout worker's core: its own base model, a rollout backend and the continuous-batching
core (:class:`~opentinker.sampling.loop.SamplingCore`) the in-process loop runs, driven by
messages (:mod:`~opentinker.workers.wire`).

:class:`WorkerCore` knows no transport: :meth:`WorkerCore.handle` takes one message and returns
the replies it answers at once, :meth:`WorkerCore.tick` runs one admission + decode step and
returns the requests it finished. A process behind a pipe (:mod:`~opentinker.workers.process`)
is one way to carry the messages; an actor is another.

Snapshots arrive as bytes in a :class:`~opentinker.workers.wire.Publish` and are registered only
once decoded whole (a message is delivered whole or not at all), so a request never runs on a
half-received snapshot: bytes that do not decode whole raise before anything is registered (in a
worker process that ends the worker, and the pool sends the snapshot again to its successor or
another worker). ``Retire`` frees them; a request already running on one keeps its
tensors until it finishes.
"""

from __future__ import annotations

import os
import time

import torch

from opentinker.engine import Engine, EngineError
from opentinker.models import load_base_model
from opentinker.sampling import NativeBackend
from opentinker.sampling.handles import SampleCancelled
from opentinker.sampling.loop import Done, SamplingCore
from opentinker.workers.wire import (
    Abort,
    Cancel,
    Inbound,
    Outbound,
    Publish,
    Published,
    Ready,
    Retire,
    Rows,
    Sample,
    WorkerOptions,
    from_bytes,
)

BACKENDS = ("native",)  # the rollout backends a worker can run


class WorkerCore:
    def __init__(self, worker: int, options: WorkerOptions) -> None:
        o = options
        if o.backend not in BACKENDS:
            raise EngineError(f"unknown rollout backend {o.backend!r} (known: {', '.join(BACKENDS)})")
        t = time.perf_counter()
        self.worker = worker
        base = load_base_model(o.base_model, dtype=o.dtype, device=o.device)
        self.engine = Engine(base, max_rank=o.max_rank, device=o.device)
        self.backend = NativeBackend(self.engine, prefix_cache_bytes=o.prefix_cache_bytes)
        self.core = SamplingCore(self.backend.decoder(), self.backend, max_rows=o.max_rows)
        self.load_s = time.perf_counter() - t
        self._rows = Rows(0, 0, 0, 0)  # what the pool was last told of the running batch

    def ready(self) -> Ready:
        return Ready(self.worker, os.getpid(), self.load_s)

    @property
    def busy(self) -> bool:
        return self.core.busy

    def handle(self, msg: Inbound) -> list[Outbound]:
        """Take one message; returns its immediate replies (an acknowledged publish, a refused or
        cancelled request)."""
        if isinstance(msg, Sample):
            return list(self.core.handle(msg))
        if isinstance(msg, Publish):
            if msg.policy_id not in self.engine.snapshot_ids():
                try:
                    weights = from_bytes(msg.weights.config, msg.weights.data, self.engine.device)
                except Exception as e:  # torn or corrupt bytes: register nothing
                    raise EngineError(f"snapshot {msg.policy_id!r} arrived incomplete: {e}") from e
                self.backend.publish(msg.policy_id, weights)
            return [Published(msg.policy_id)]
        if isinstance(msg, Retire):
            if msg.policy_id in self.engine.snapshot_ids():
                self.backend.retire(msg.policy_id)
            return []
        if isinstance(msg, Abort):  # its rows leave the running batch now; nobody waits for them
            self.core.handle(msg)
            return self._rows_changed()
        if isinstance(msg, Cancel):
            if self.core.cancel(msg.rid):
                return [Done(msg.rid, error=SampleCancelled(f"sample request {msg.rid} was cancelled"))]
            return []
        raise TypeError(f"a rollout worker cannot handle {type(msg).__name__}")

    def tick(self) -> list[Outbound]:
        """One admission + decode step: the tokens streamed requests decoded, the requests it
        finished, and the running batch if it changed. A failure fails the requests it touched,
        never the worker."""
        pieces: list[Outbound] = []
        try:
            done = self.core.tick()
            pieces += [piece for piece, _ in self.core.progress()]
        except Exception as e:
            done = [Done(rid, error=e) for rid in self.core.decoder.running()]
        return self._rows_changed() + pieces + done  # the batch first: it is current when the tokens come

    def _rows_changed(self) -> list[Outbound]:
        st = self.core.stats
        rows = Rows(st.live_rows, st.waiting, st.steps, st.aborted)
        if (rows.live_rows, rows.waiting, rows.aborted) == (
            self._rows.live_rows,
            self._rows.waiting,
            self._rows.aborted,
        ):  # the steps alone: not worth a message per step
            return []
        self._rows = rows
        return [rows]

    def snapshot_ids(self) -> list[str]:
        return self.engine.snapshot_ids()

    @torch.no_grad()
    def close(self) -> None:
        for sid in self.engine.snapshot_ids():
            self.engine.release_snapshot(sid)
