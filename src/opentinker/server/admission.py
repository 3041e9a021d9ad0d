"""Per-tenant admission: how many of a tenant's requests may be queued on the engines at once.

Two limits bound a tenant. ``max_pending`` (:mod:`futures`) counts every unfinished request and
refuses more with 429. Below it, ``max_running`` counts the requests handed to the schedulers: a
tenant past it has its next requests *held here*, in arrival order, and each starts when one of
the tenant's running requests finishes. A held request already has its request id; its polls answer
``try_again`` with the SDK's queue state ``paused_rate_limit`` and a reason naming the limit, which
the SDK hands to its queue-state observer (it logs a pause that lasts). Arrival order per tenant
is kept, so a model's requests still reach its scheduler in ``seq_id`` order.

Starts always run on the event loop (a finishing request's callback comes from a scheduler thread;
the start is posted back to the loop), like every other submission of the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from opentinker.server.futures import QueueState, fail

Start = Callable[[], None]


@dataclass
class _Waiting:
    out: Future
    start: Start
    loop: asyncio.AbstractEventLoop


class Admission:
    def __init__(self, max_running: int) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.max_running = max_running
        self._running: dict[str, int] = defaultdict(int)
        self._waiting: dict[str, deque[_Waiting]] = defaultdict(deque)
        self._lock = threading.Lock()

    def submit(self, tenant: str, out: Future, start: Start) -> None:
        """Run ``start`` now if ``tenant`` is under its limit, else when its turn comes. ``out``
        is the request's result future: its completion frees the slot."""
        with self._lock:
            if self._running[tenant] >= self.max_running or self._waiting[tenant]:
                self._waiting[tenant].append(_Waiting(out, start, asyncio.get_running_loop()))
                return
            self._running[tenant] += 1
        self._start(tenant, out, start)

    def _start(self, tenant: str, out: Future, start: Start) -> None:
        out.add_done_callback(lambda _: self._finished(tenant))
        try:
            start()
        except BaseException as e:  # a refused request fails alone
            fail(out, e)

    def _finished(self, tenant: str) -> None:
        with self._lock:
            self._running[tenant] -= 1
            nxt = self._next(tenant)
        if nxt is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server is stopping
                nxt.loop.call_soon_threadsafe(self._start, tenant, nxt.out, nxt.start)

    def _next(self, tenant: str) -> _Waiting | None:
        q = self._waiting[tenant]
        while q and q[0].out.done():  # failed while it waited (its model closed, cancelled)
            q.popleft()
        if not q or self._running[tenant] >= self.max_running:
            return None
        self._running[tenant] += 1
        return q.popleft()

    def counts(self) -> tuple[int, int]:
        """(running, held) requests over every tenant now (``/metrics``)."""
        with self._lock:
            return sum(self._running.values()), sum(len(q) for q in self._waiting.values())

    def state(self, tenant: str, out: Future) -> tuple[QueueState, str | None]:
        with self._lock:
            waiting = any(w.out is out for w in self._waiting[tenant])
            running = self._running[tenant]
        if not waiting:
            return "active", None
        return "paused_rate_limit", (
            f"this tenant has {running} requests running (the limit is {self.max_running}); "
            "this one starts when one of them finishes"
        )

    def cancel(self, tenant: str, out: Future) -> bool:
        """Drop a request still waiting here (True), else False."""
        with self._lock:
            q = self._waiting[tenant]
            for w in q:
                if w.out is out:
                    q.remove(w)
                    return True
        return False
