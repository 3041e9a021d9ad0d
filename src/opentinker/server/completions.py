"""Completion queues of sampling sessions, answered by ``/retrieve_futures`` (batch polling).

With ``sample_use_retrieve_futures`` on (``/client/config``), the SDK 0.38 runs one poller per
(sampling session, clone) instead of one ``/retrieve_future`` long-poll per sample: it long-polls
``/retrieve_futures`` with a cursor, learns which of the session's requests finished or failed, and
only then fetches each result through ``/retrieve_future``. So here every sample request is queued
under its key ``(sampling_session_id, seq_id // 1_000_000_000)`` — the clone id the SDK puts in the
top of its ``seq_id``s — and its completion becomes one event::

    {"state": "finished", "request_id": …, "response_payload_uncompressed_size": <bytes>}
    {"state": "failed", "request_id": …}

Cursors are event numbers, opaque to the client. A poll returns the events after ``prev_cursor``
and drops those at or before it (the client has seen them). Cursors start at a per-process base,
so a cursor this process never issued is recognised: it comes from a client of an earlier process
and is read as 0 (everything of this process is news to it), so the client goes on sampling. What
the SDK's poller cannot learn is that a request it sent the earlier process is lost — it names no
requests it waits for — so such a waiter waits for its stuck-detection (2 h). That is why batch
polling is off unless ``serve --batch-polling``: per-request polling answers a lost request
"unknown" at once (see :mod:`futures`).

Limits: a queue nobody polls (a client with the flag off) keeps at most ``max_events`` events,
each at most ``ttl_s`` — as long as the results themselves are kept; an empty queue whose sampler
has sent nothing for ``ttl_s`` is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from opentinker.server.errors import BadRequest

Key = tuple[str, int]  # (sampling_session_id, clone id)
CLONE_BLOCK = 1_000_000_000  # the SDK numbers clone c's requests c·10⁹, c·10⁹ + 1, …


@dataclass
class _Queue:
    loop: asyncio.AbstractEventLoop
    events: deque[tuple[int, float, dict[str, Any]]] = field(default_factory=deque)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    used: float = field(default_factory=time.monotonic)  # last tracked request


class CompletionQueues:
    def __init__(self, *, ttl_s: float, max_events: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_events = max_events
        self._base = int(time.time() * 1000) << 20  # never reused by a later process
        self._issued = 0
        self._queues: dict[Key, _Queue] = {}
        self._lock = threading.Lock()
        self._swept = time.monotonic()

    def track(self, key: Key, request_id: str, result: Future) -> None:
        """Report ``request_id`` on ``key``'s queue when ``result`` (its wire payload) is done.
        Called on the event loop."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        with self._lock:
            if now - self._swept > min(60.0, self.ttl_s):  # queues of samplers long idle
                self._swept = now
                for k in [k for k, q in self._queues.items() if not q.events and now - q.used > self.ttl_s]:
                    del self._queues[k]
            q = self._queues.get(key)
            if q is None:
                q = self._queues[key] = _Queue(loop)
            q.used = now

        def done(f: Future) -> None:
            if f.exception() is None:
                payload = f.result()
                size = len(payload) if isinstance(payload, bytes | bytearray) else None
                event: dict[str, Any] = {"state": "finished", "request_id": request_id}
                if size:
                    event["response_payload_uncompressed_size"] = size
            else:
                event = {"state": "failed", "request_id": request_id}
            self._append(key, event)

        result.add_done_callback(done)

    def _append(self, key: Key, event: dict[str, Any]) -> None:
        now = time.monotonic()
        with self._lock:
            q = self._queues.get(key)
            if q is None:
                return
            self._issued += 1
            q.events.append((self._base + self._issued, now, event))
            while len(q.events) > self.max_events or (q.events and now - q.events[0][1] > self.ttl_s):
                q.events.popleft()
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is polling
            q.loop.call_soon_threadsafe(q.changed.set)

    async def poll(self, key: Key, prev_cursor: int, timeout: float) -> tuple[list[dict[str, Any]], int]:
        """The events of ``key`` after ``prev_cursor`` (waiting up to ``timeout`` s for one) and
        the cursor to send next."""
        with self._lock:
            issued = self._base + self._issued
        if prev_cursor < 0:
            raise BadRequest(f"prev_cursor must be >= 0, got {prev_cursor}")
        if not self._base < prev_cursor <= issued:
            prev_cursor = 0  # 0, or issued by an earlier process: all of this one's events are new
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                q = self._queues.get(key)
                if q is None:
                    return [], prev_cursor
                while q.events and q.events[0][0] <= prev_cursor:
                    q.events.popleft()
                if q.events:
                    return [e for _, _, e in q.events], q.events[-1][0]
                q.changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return [], prev_cursor
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(q.changed.wait(), remaining)
