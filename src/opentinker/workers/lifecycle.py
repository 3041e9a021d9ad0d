"""The worker pool's worker lifecycle: starting, scaling and draining workers, and a worker's
death and restart; the reads of each worker's state.

:class:`WorkerLifecycle` is that half of :class:`~opentinker.workers.pool.WorkerPool` (mixed
into it; the pool's records are :mod:`~opentinker.workers.slots`). The other half, the pool
itself, takes requests, routes them and hands snapshots over on its dispatcher thread; a worker's
death found there comes here (:meth:`WorkerLifecycle._died`).

**Faults.** A worker whose process ends (``kill -9``) or whose pipe breaks: its in-flight
requests go back to the front of the queue and run on another worker (or on it again once it is
back). The dead worker is restarted (its start-up handshake on a thread of its own; the others
keep serving), up to :data:`RESTART_ATTEMPTS` tries; one that cannot come back is ``failed``.

**Scaling.** :meth:`WorkerLifecycle.scale` changes the number of serving workers while requests
run. New workers start first (all of them, or none join: a worker that cannot start leaves the
pool as it was) and then serve the current snapshots on first use. A removed worker *drains*: no
new request is routed to it, its running requests finish there, and only then is it stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from opentinker.workers.process import WorkerStartError
from opentinker.workers.slots import Req, Slot, start_all
from opentinker.workers.transport import Transport, WorkerHandle
from opentinker.workers.wire import Ready, Rows, WorkerOptions

log = logging.getLogger(__name__)

RESTART_ATTEMPTS = 3


class WorkerLifecycle:
    """The worker half of :class:`~opentinker.workers.pool.WorkerPool` (module docstring)."""

    transport: Transport
    options: WorkerOptions
    startup_timeout: float
    ready: list[Ready]
    _lock: threading.RLock
    _scaling: threading.Lock
    _slots: list[Slot]
    _pending: deque[Req]
    _rerun: int
    _stopped: bool

    def _wake(self) -> None:
        """Wake the dispatcher (the pool's)."""
        raise NotImplementedError

    def worker_pids(self) -> list[int | None]:
        """Each worker's process id (None while it (re)starts, or once removed)."""
        with self._lock:
            return [
                s.handle.pid if s.handle is not None and s.state in ("ready", "draining") else None
                for s in self._slots
            ]

    def worker_states(self) -> list[str]:
        """Each worker's state: starting, ready, dead (restarting), failed, draining or removed."""
        with self._lock:
            return [s.state for s in self._slots]

    def worker_handle(self, index: int) -> WorkerHandle | None:
        """Worker ``index``'s transport handle (None while it restarts)."""
        with self._lock:
            return self._slots[index].handle

    @property
    def size(self) -> int:
        """Workers serving or coming back (not draining, removed or failed for good)."""
        with self._lock:
            return sum(1 for s in self._slots if s.state in ("ready", "starting", "dead"))

    def worker_snapshots(self, index: int) -> set[str]:
        """The wire ids worker ``index`` has acknowledged (snapshots it holds)."""
        with self._lock:
            return set(self._slots[index].acked)

    def add_worker(self) -> int:
        """Start one more worker (a late joiner: it receives snapshots on first use); returns its
        index once it serves. Raises :class:`~opentinker.workers.process.WorkerStartError`."""
        with self._scaling:
            return self._add(1)[0]

    def scale(self, workers: int, *, drain_timeout: float = 600.0) -> int:
        """Serve from ``workers`` workers: start the missing ones (all join or none does), or drain
        and stop the newest ones beyond it (each finishes what it runs). Returns the new count.
        Raises ``ValueError`` (below one worker, or more than the transport can place) and
        :class:`~opentinker.workers.process.WorkerStartError`, leaving the pool as it was."""
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {workers!r}")
        with self._scaling:
            now = self.size
            if workers > now:
                self._add(workers - now)
            elif workers < now:
                self._drain(now - workers, drain_timeout)
            return self.size

    def _add(self, n: int) -> list[int]:
        """Start ``n`` workers; once all serve they join the pool (none joins if one fails)."""
        if self._stopped:
            raise RuntimeError("the rollout worker pool is shut down")
        self.transport.check_capacity(n)
        with self._lock:
            first = len(self._slots)
        handles = [self.transport.worker(first + i, self.options, self.startup_timeout) for i in range(n)]
        self.ready += start_all(handles)
        with self._lock:
            if self._stopped:
                for h in handles:
                    h.stop()
                raise RuntimeError("the rollout worker pool is shut down")
            for h in handles:
                self._slots.append(Slot(h.index, h, "ready"))
        self._wake()
        return [h.index for h in handles]

    def _drain(self, n: int, timeout: float) -> None:
        """Stop routing to the newest ``n`` serving workers; return once each has finished."""
        with self._lock:
            chosen = [s for s in reversed(self._slots) if s.state == "ready"][:n]
            if len(chosen) < n:
                raise ValueError(f"only {len(chosen)} rollout workers serve now; cannot remove {n}")
            for s in chosen:
                s.state = "draining"
                self._finish_drain(s)
        self._wake()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(s.state == "removed" for s in chosen):
                    return
            time.sleep(0.02)
        raise TimeoutError(f"rollout workers did not drain within {timeout:.0f} s")

    def _finish_drain(self, slot: Slot) -> None:
        """A draining worker with nothing left running is stopped (under the lock)."""
        if slot.state != "draining" or slot.inflight:
            return
        slot.state = "removed"
        handle, slot.handle = slot.handle, None
        slot.published.clear()
        slot.acked.clear()
        if handle is not None:
            threading.Thread(target=handle.stop, name=f"opentinker-stop-{slot.index}", daemon=True).start()

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until every worker serves (after a restart); raises ``TimeoutError``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(s.state in ("ready", "failed", "draining", "removed") for s in self._slots):
                    return
            time.sleep(0.05)
        raise TimeoutError("rollout workers did not come back")

    def _died(self, slot: Slot, why: str) -> None:
        """Re-queue the dead worker's requests (ahead of the rest) and restart it (a draining one
        is not restarted: it was leaving)."""
        if slot.state not in ("ready", "draining"):
            return
        draining = slot.state == "draining"
        log.warning(
            "rollout worker %d died (%s); re-running %d requests", slot.index, why, len(slot.inflight)
        )
        slot.state = "dead"
        slot.batch = Rows(0, 0, 0, 0)  # a new worker starts its counts afresh
        back = sorted(slot.inflight.values(), key=lambda r: r.rid)
        slot.inflight.clear()
        slot.published.clear()
        slot.acked.clear()
        for r in back:
            r.worker = None
        self._rerun += len(back)
        self._pending.extendleft(reversed(back))
        handle = slot.handle
        slot.handle = None
        if draining:
            slot.state = "removed"
            if handle is not None:
                threading.Thread(target=handle.kill, daemon=True).start()
            return
        threading.Thread(
            target=self._restart, args=(slot, handle), name=f"opentinker-restart-{slot.index}", daemon=True
        ).start()

    def _restart(self, slot: Slot, old: WorkerHandle | None) -> None:
        if old is not None:
            old.kill()
        err = ""
        for attempt in range(RESTART_ATTEMPTS):
            if self._stopped:
                return
            with self._lock:
                slot.state = "starting"
            handle = self.transport.worker(slot.index, self.options, self.startup_timeout)
            try:
                handle.start()
            except WorkerStartError as e:
                err = str(e)
                log.warning("restarting rollout worker %d failed: %s", slot.index, e)
                time.sleep(1.0 * (attempt + 1))
                continue
            with self._lock:
                if self._stopped:
                    handle.stop()
                    return
                slot.handle, slot.state = handle, "ready"
                slot.restarts += 1
            self._wake()
            return
        with self._lock:
            slot.state, slot.error = "failed", err
        self._wake()
