"""The worker pool's records: a request it holds, a worker's slot, its counters, and starting
workers together (:mod:`~opentinker.workers.pool` and its :mod:`~opentinker.workers.lifecycle`
are their only users)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

from opentinker.sampling.decoder import Pinned
from opentinker.workers.transport import WorkerHandle
from opentinker.workers.wire import Ready, Rows


@dataclass
class Req:
    rid: int
    pinned: Pinned
    future: Future
    wire: str | None  # the policy's wire id (None: the bare base model)
    worker: int | None = None  # the worker it is assigned to

    @property
    def rows(self) -> int:
        return self.pinned.req.num_samples


@dataclass
class Slot:
    index: int
    handle: WorkerHandle | None = None
    # draining: takes no new request, stopped once its running ones finish; removed: stopped
    state: Literal["starting", "ready", "dead", "failed", "draining", "removed"] = "starting"
    published: set[str] = field(default_factory=set)  # wire ids sent to this process
    acked: set[str] = field(default_factory=set)  # ... and acknowledged whole
    inflight: dict[int, Req] = field(default_factory=dict)
    served: int = 0  # requests it answered
    restarts: int = 0
    error: str = ""
    batch: Rows = field(default_factory=lambda: Rows(0, 0, 0, 0))  # its running batch, as it last said

    @property
    def rows(self) -> int:
        return sum(r.rows for r in self.inflight.values())


@dataclass
class PoolStats:
    served: list[int]  # requests answered, per worker
    restarts: list[int]  # restarts, per worker
    rerun: int  # requests re-run after their worker died
    published: int  # snapshot handoffs sent (a version to one worker)
    retired: int  # retires sent
    prefix_routed: int  # requests sent to the worker holding their prefix
    # the workers' running batches (as each last reported), summed: rows decoding, requests
    # waiting for room (in the pool or on a worker), decode steps run, requests aborted mid-decode
    live_rows: int = 0
    waiting: int = 0
    steps: int = 0
    aborted: int = 0


def start_all(handles: list[WorkerHandle]) -> list[Ready]:
    """Start every worker at once (their loads overlap) and wait for all handshakes; if one
    fails, every one is stopped and its error raised."""
    results: list[Ready | BaseException | None] = [None] * len(handles)

    def go(i: int) -> None:
        try:
            results[i] = handles[i].start()
        except BaseException as e:
            results[i] = e

    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(len(handles))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for res in results:
        if isinstance(res, BaseException):
            for h in handles:
                h.kill()
            raise res
    return [r for r in results if isinstance(r, Ready)]
