"""Request ids → futures of wire payloads, answered by long-polling ``/retrieve_future``.

Every accepted operation gets a request id at once and a ``concurrent.futures.Future`` of its
*encoded* result (protobuf bytes or a JSON dict), completed later by the scheduler thread. A poll
waits on an ``asyncio.Event`` set from that thread, so a result is answered the moment it exists
and an unfinished one answers ``try_again`` after ``poll_timeout_s`` (the SDK polls again at once).

Request ids carry a per-process boot id: after a restart every old id is simply unknown and
answers an error saying so — a request in flight at a crash never hangs a client.

Limits: each tenant may have at most ``max_pending`` unfinished futures (429 beyond); finished
ones are kept ``result_ttl_s`` for retried polls, then dropped (or as soon as the SDK reports them
retrieved, see :meth:`FutureStore.drop`).

An unfinished request's try-again answer carries the SDK's queue state (``active``,
``paused_capacity``, ``paused_rate_limit``) and a reason: whoever queued the work may attach a
function saying whether a limit holds it back right now (:meth:`FutureStore.hooks`), and one that
cancels it while it has not started (``/cancel_future``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Literal

from opentinker.server.errors import TooManyPending, UserError
from opentinker.service import SampleCancelled

QueueState = Literal["active", "paused_capacity", "paused_rate_limit"]
StateFn = Callable[[], tuple[QueueState, str | None]]  # (the SDK's queue state, why)
CancelFn = Callable[[], bool]  # True if the work was stopped before it started


@dataclass
class _Entry:
    tenant: str
    future: Future
    event: asyncio.Event
    loop: asyncio.AbstractEventLoop
    done_at: float | None = None
    created: float = field(default_factory=time.monotonic)
    state: StateFn | None = None
    cancel: CancelFn | None = None


PollState = Literal["unknown", "pending", "done"]
CancelOutcome = Literal["unknown", "finished", "cancelled", "running"]


class Cancelled(UserError):
    """The client cancelled the request (``/cancel_future``) before it ran."""


class FutureStore:
    def __init__(self, *, max_pending: int, result_ttl_s: float) -> None:
        self.boot_id = secrets.token_hex(4)
        self.max_pending = max_pending
        self.result_ttl_s = result_ttl_s
        self._entries: dict[str, _Entry] = {}
        self._pending: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._last_sweep = time.monotonic()

    def create(self, tenant: str, *, exempt: bool = False) -> tuple[str, Future]:
        """A new request id and the future its result goes into; 429 if the tenant has too many
        (unless ``exempt``: a request others already accepted wait for, which must get in)."""
        loop = asyncio.get_running_loop()
        self._maybe_sweep()
        with self._lock:
            if self._pending[tenant] >= self.max_pending and not exempt:
                raise TooManyPending(
                    f"this tenant has {self._pending[tenant]} unfinished requests (the limit is "
                    f"{self.max_pending}); retry when some have finished"
                )
            self._pending[tenant] += 1
            request_id = f"req-{self.boot_id}-{next(self._ids)}"
            entry = _Entry(tenant, Future(), asyncio.Event(), loop)
            self._entries[request_id] = entry
        entry.future.add_done_callback(lambda _f: self._finished(entry))
        return request_id, entry.future

    def _finished(self, entry: _Entry) -> None:
        with self._lock:
            entry.done_at = time.monotonic()
            self._pending[entry.tenant] -= 1
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is polling
            entry.loop.call_soon_threadsafe(entry.event.set)

    def hooks(self, request_id: str, *, state: StateFn | None = None, cancel: CancelFn | None = None) -> None:
        """Attach what says a request's queue state, and what cancels it before it starts."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None:
                entry.state = state or entry.state
                entry.cancel = cancel or entry.cancel

    def queue_state(self, request_id: str) -> tuple[QueueState, str | None]:
        with self._lock:
            entry = self._entries.get(request_id)
        if entry is None or entry.state is None:
            return "active", None
        return entry.state()

    def future_of(self, request_id: str) -> Future | None:
        with self._lock:
            entry = self._entries.get(request_id)
        return None if entry is None else entry.future

    def cancel(self, request_id: str, tenant: str) -> CancelOutcome:
        """Stop a request of ``tenant`` that has not started; its poll then answers an error."""
        with self._lock:
            entry = self._entries.get(request_id)
        if entry is None or entry.tenant != tenant:
            return "unknown"
        if entry.future.done():
            return "finished"
        if entry.cancel is None or not entry.cancel():
            return "running"
        fail(entry.future, Cancelled(f"request {request_id} was cancelled by the client before it ran"))
        return "cancelled"

    def drop(self, request_ids: list[str], tenant: str) -> None:
        """Forget finished results the client reports it has retrieved (others are left alone)."""
        with self._lock:
            for rid in request_ids:
                entry = self._entries.get(rid)
                if entry is not None and entry.tenant == tenant and entry.done_at is not None:
                    del self._entries[rid]

    def counts(self) -> tuple[int, int]:
        """(unfinished, finished and kept for polls) requests over every tenant (``/metrics``)."""
        with self._lock:
            done = sum(1 for e in self._entries.values() if e.done_at is not None)
            return len(self._entries) - done, done

    def pending(self, tenant: str) -> int:
        with self._lock:
            return self._pending[tenant]

    async def wait(self, request_id: str, tenant: str, timeout: float) -> tuple[PollState, Future | None]:
        """Wait up to ``timeout`` s for a request of ``tenant``; another tenant's id is unknown."""
        with self._lock:
            entry = self._entries.get(request_id)
        if entry is None or entry.tenant != tenant:
            return "unknown", None
        if not entry.future.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(entry.event.wait(), timeout)
        if not entry.future.done():
            return "pending", None
        return "done", entry.future

    def _maybe_sweep(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep < min(60.0, self.result_ttl_s / 4):
            return
        self._last_sweep = now
        with self._lock:
            old = [
                rid
                for rid, e in self._entries.items()
                if e.done_at is not None and now - e.done_at > self.result_ttl_s
            ]
            for rid in old:
                del self._entries[rid]


def chain(src: Future, out: Future, encode: Callable[[Any], Any]) -> None:
    """Complete ``out`` with ``encode(src.result())`` (or ``src``'s / ``encode``'s exception)."""

    def done(f: Future) -> None:
        try:
            value = encode(f.result())
        except SampleCancelled:
            return  # cancelled by the client: the canceller answers ``out`` (FutureStore.cancel)
        except BaseException as e:
            fail(out, e)
            return
        with contextlib.suppress(InvalidStateError):  # already failed elsewhere (its model closed)
            out.set_result(value)

    src.add_done_callback(done)


def fail(out: Future, exc: BaseException) -> None:
    with contextlib.suppress(InvalidStateError):
        out.set_exception(exc)
