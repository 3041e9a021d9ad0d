"""Sample handles: what submitting a sample returns, and the one book of requests every sampling
service keeps.

A sampling service (:class:`SamplingService`: the in-process sampling loop, the rollout worker
pool, a sharded group's sampler) answers ``submit`` with a :class:`SampleHandle`: the request's
**request id** (1, 2, 3, … in the service's submission order) and its future. ``state``,
``cancel`` and ``abort`` take the handle. Where a request stands is one of :data:`SampleState`:

* ``queued``: not yet taken by the service's server thread;
* ``held_back``: taken, but waiting for room in the running batch (the sampler is at capacity);
* ``taken``: decoding, answered, or unknown.

:class:`RequestBook` is the bookkeeping the services share: request ids, the unanswered requests'
entries, the lock, refusing a request whose policy does not pin, cancelling one that still waits
and aborting one wherever it is. A service says only where its requests wait and how a running
one is stopped (its hooks).
"""

from __future__ import annotations

import itertools
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

from opentinker.engine import EngineError
from opentinker.sampling.decoder import Pinned
from opentinker.sampling.types import SampleRequest, SampleResult

SampleState = Literal["queued", "held_back", "taken"]


@dataclass(frozen=True)
class SampleHandle:
    """A submitted sample request: its request id (0: refused at submission, its future failed)
    and the future of its result."""

    request_id: int
    future: Future[SampleResult]


class SampleCancelled(RuntimeError):
    """A sample request was cancelled before it was admitted (it was never decoded), or aborted
    by its caller. Whoever cancels it answers its caller (the server fails the request's own
    future first)."""


class SamplingService(Protocol):
    """What the scheduler hands samples to: the sampling loop (a thread in this process) or a
    pool of worker processes or actors (:mod:`opentinker.workers.pool`). ``abort`` drops a request
    wherever it is, its rows leaving the running batch (in process or on the worker decoding it);
    ``follow`` moves inflight requests to newer weights where it can (else they finish on the
    weights they started with). Both stream a request's tokens to its ``stream`` sink."""

    @property
    def max_rows(self) -> int:
        """Sampled sequences decoded together at most (per worker)."""
        ...

    def submit(self, req: SampleRequest) -> SampleHandle: ...
    def state(self, handle: SampleHandle) -> SampleState: ...
    def cancel(self, handle: SampleHandle) -> bool: ...
    def abort(self, handle: SampleHandle) -> bool: ...
    def follow(self, group: str, policy_id: str) -> None: ...
    def shutdown(self) -> None: ...


E = TypeVar("E")  # what a service keeps of an unanswered request


class RequestBook(ABC, Generic[E]):
    """The unanswered requests of one sampling service, by request id (module docstring).

    ``_lock`` guards them (and whatever the service's hooks touch); its server threads wait on
    ``_cv``, a condition over it.
    """

    what = "the sampler"  # the service, as its errors name it

    def __init__(self) -> None:
        self._lock = threading.RLock()  # reentrant: a service's hooks may call its own locked helpers
        self._cv = threading.Condition(self._lock)
        self._open: dict[int, E] = {}  # every unanswered request
        self._ids = itertools.count(1)
        self._stopped = False

    # ------------------------------------------------------------------ what a service says
    @abstractmethod
    def _pin(self, req: SampleRequest) -> Pinned:
        """Validate ``req`` and resolve its weights (``EngineError`` naming the problem)."""

    @abstractmethod
    def _enqueue(self, rid: int, pinned: Pinned, future: Future[SampleResult]) -> E:
        """Queue request ``rid`` for the server thread (lock held); returns what is kept of it."""

    @staticmethod
    @abstractmethod
    def _future(entry: E) -> Future[SampleResult]:
        """The future of a kept request."""

    @abstractmethod
    def _where(self, rid: int) -> SampleState:
        """Where unanswered-or-not request ``rid`` stands (lock held)."""

    @abstractmethod
    def _unqueue(self, rid: int) -> bool:
        """Take request ``rid`` out of the queues if it still waits there (lock held)."""

    @abstractmethod
    def _stop(self, rid: int) -> None:
        """Stop request ``rid``, which runs (lock held; its entry is gone, its caller answered)."""

    def _woken(self) -> None:
        """After a submit or an abort, outside the lock: wake a server not waiting on ``_cv``."""

    # ------------------------------------------------------------------ the service's face
    def submit(self, req: SampleRequest) -> SampleHandle:
        """Sample ``req``, pinned now (on the caller's thread) to the weights its policy names; a
        request that does not pin gets a handle with request id 0 and its error in the future."""
        fut: Future[SampleResult] = Future()
        try:
            pinned = self._pin(req)
        except EngineError as e:
            fut.set_exception(e)
            return SampleHandle(0, fut)
        with self._cv:
            if self._stopped:
                raise RuntimeError(f"{self.what} is shut down")
            rid = next(self._ids)
            self._open[rid] = self._enqueue(rid, pinned, fut)
            self._cv.notify_all()
        self._woken()
        return SampleHandle(rid, fut)

    def state(self, handle: SampleHandle) -> SampleState:
        with self._cv:
            return self._where(handle.request_id)

    def cancel(self, handle: SampleHandle) -> bool:
        """Drop the request before it is admitted: its future fails with :class:`SampleCancelled`
        and it is never decoded (True). An admitted or answered one is left alone (False)."""
        rid = handle.request_id
        with self._cv:
            if rid not in self._open or not self._unqueue(rid):
                return False
            entry = self._open.pop(rid)
        self._future(entry).set_exception(
            SampleCancelled(f"sample request {rid} was cancelled before it ran")
        )
        return True

    def abort(self, handle: SampleHandle) -> bool:
        """Drop the request wherever it is: its future fails with :class:`SampleCancelled` at once;
        waiting, it is never decoded; running, the service stops it (its rows leave the running
        batch where the service can). False if it has been answered already (or is unknown)."""
        rid = handle.request_id
        with self._cv:
            entry = self._open.pop(rid, None)
            if entry is None:
                return False
            if not self._unqueue(rid):
                self._stop(rid)
            self._cv.notify_all()
        self._woken()
        self._future(entry).set_exception(SampleCancelled(f"sample request {rid} was aborted by its caller"))
        return True

    # ------------------------------------------------------------------ for the server thread
    def _answered(self, rid: int) -> E | None:
        """The entry of request ``rid``, now answered (lock held); None: answered already."""
        return self._open.pop(rid, None)

    def _close(self) -> list[E]:
        """Refuse new requests; the unanswered ones, forgotten here (lock held)."""
        self._stopped = True
        left = list(self._open.values())
        self._open.clear()
        self._cv.notify_all()
        return left
