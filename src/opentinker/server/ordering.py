"""Per-model ``seq_id`` order and request idempotency (invariant 7).

The SDK numbers each training model's requests 1, 2, 3, … and sends the chunks of one
``forward_backward`` *in parallel*, the first chunk last. The server must run them in ``seq_id``
order, yet answer each POST at once (the SDK waits for the later chunks' answers before it sends
the first). So each model has a small **reorder buffer**: a request whose turn has not come is
held (it already has its request id) and submitted to the embedded client — whose scheduler
keeps submission order — as soon as every lower ``seq_id`` has been submitted.

**Idempotency**: a request is identified by its key (``(model_id, seq_id)``, ``(sampler, seq_id)``,
``(session, model_seq_id)``, …) and a digest of its canonical body. The same key with the same
digest returns what the first one got (its request id, or the id it created); the same key with
another digest is refused.

A ``seq_id`` that never arrives (a client that died mid-send) would stall its model forever; a
request held longer than ``gap_timeout_s`` therefore runs anyway, and the missing one is refused if
it turns up later.

Only a window of ``max_ahead`` ``seq_id``s past the next expected one may wait: the SDK never has
more requests of one model in flight than that, and a ``seq_id`` far beyond it (2³¹−1, say) is a
broken client. Held, it would be run after the gap timeout and make every later honest request
"late" — the model would be bricked — so it is refused at once, and the model goes on as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from opentinker.server.errors import BadRequest, UserError
from opentinker.server.futures import fail

log = logging.getLogger(__name__)

Start = Callable[[], None]  # submits one held request to the embedded client
MAX_AHEAD = 1024  # seq_ids past a model's next expected one that may wait for it


class Idempotency:
    """Remembers ``key -> (digest, value)`` for the last ``capacity`` keys."""

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[Hashable, tuple[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, key: Hashable, digest: str, what: str) -> Any | None:
        """The value remembered for ``key`` (None if new); a different body for it is refused."""
        with self._lock:
            hit = self._seen.get(key)
        if hit is None:
            return None
        if hit[0] != digest:
            raise BadRequest(f"{what} was already used by a different request; ids must not be reused")
        return hit[1]

    def remember(self, key: Hashable, digest: str, value: Any) -> None:
        with self._lock:
            self._seen[key] = (digest, value)
            self._seen.move_to_end(key)
            while len(self._seen) > self.capacity:
                self._seen.popitem(last=False)

    def forget(self, key: Hashable) -> None:
        with self._lock:
            self._seen.pop(key, None)


@dataclass
class _Held:
    start: Start
    out: Future
    since: float = field(default_factory=time.monotonic)


@dataclass
class _Model:
    next_seq: int = 1
    held: dict[int, _Held] = field(default_factory=dict)


class Sequencer:
    """The reorder buffers of all models, plus their idempotency record."""

    def __init__(self, *, max_ahead: int = MAX_AHEAD) -> None:
        self.max_ahead = max_ahead
        self.seen = Idempotency()
        self._models: dict[str, _Model] = {}
        self._lock = threading.RLock()

    def open(self, model_id: str, next_seq: int = 1) -> None:
        with self._lock:
            self._models.setdefault(model_id, _Model(next_seq))

    def lookup(self, model_id: str, seq_id: int, digest: str) -> str | None:
        """The request id of an earlier identical request, or None for a new one."""
        return self.seen.check((model_id, seq_id), digest, f"seq_id {seq_id} of model {model_id}")

    def submit(
        self, model_id: str, seq_id: int, digest: str, request_id: str, out: Future, start: Start
    ) -> None:
        """Run ``start`` now if it is ``model_id``'s turn, else hold it until it is."""
        with self._lock:
            m = self._models.setdefault(model_id, _Model())
            if seq_id < m.next_seq:
                raise BadRequest(
                    f"seq_id {seq_id} of model {model_id} arrived after later requests already ran "
                    f"(next expected: {m.next_seq}); seq_ids must increase"
                )
            if seq_id in m.held:
                raise BadRequest(f"seq_id {seq_id} of model {model_id} is already queued")
            if seq_id >= m.next_seq + self.max_ahead:  # also bounds how many can be held
                raise BadRequest(
                    f"seq_id {seq_id} of model {model_id} is too far ahead: the next expected is "
                    f"{m.next_seq}, and at most {self.max_ahead} seq_ids past it may wait"
                )
            self.seen.remember((model_id, seq_id), digest, request_id)
            m.held[seq_id] = _Held(start, out)
            self._drain(m)

    def _drain(self, m: _Model) -> None:
        while m.next_seq in m.held:
            held = m.held.pop(m.next_seq)
            m.next_seq += 1
            try:
                held.start()
            except BaseException as e:  # a refused request fails alone; the order goes on
                fail(held.out, e)

    def skip_gaps(self, gap_timeout_s: float) -> int:
        """Run requests held longer than ``gap_timeout_s`` past their missing predecessors."""
        now = time.monotonic()
        skipped = 0
        with self._lock:
            for model_id, m in self._models.items():
                if m.held and now - min(h.since for h in m.held.values()) > gap_timeout_s:
                    first = min(m.held)
                    log.warning(
                        "model %s: seq_ids %d..%d never arrived; running on", model_id, m.next_seq, first - 1
                    )
                    skipped += first - m.next_seq
                    m.next_seq = first
                    self._drain(m)
        return skipped

    def close(self, model_id: str, reason: str) -> None:
        """Forget a model; requests still held for it fail with ``reason``."""
        with self._lock:
            m = self._models.pop(model_id, None)
        if m is not None:
            for held in m.held.values():
                fail(held.out, UserError(reason))
