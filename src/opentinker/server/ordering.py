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

**Gaps.** The SDK takes a ``seq_id`` for every training call before sending it, and never sends it
twice unless the answer was retryable (408/409/429/5xx or no answer: it resends the *same* body
with the same ``seq_id``, backing off 1, 2, 4, … s). A send refused with any other 4xx is given up:
its ``seq_id`` is spent and the SDK's next call takes the next one (``TrainingClient._take_turn``
moves on in its ``finally``). So a ``seq_id`` the server refused outright will never come, and
:meth:`Sequencer.refused` records that; a later request waiting only for refused ``seq_id``s runs
at once. (A refused ``seq_id`` may still be sent again, fixed, while nothing later waits for it.)
A ``seq_id`` that never arrives at all (lost in transit, a client that died mid-send, a body too
big to read) would stall its model forever; so once the model has waited ``gap_timeout_s`` for it,
the requests held right behind the gap fail with an error naming the missing ``seq_id`` — running
them would reorder the client's program (an ``optim_step`` without its ``forward_backward``) — and
the model goes on with the requests after them. The missing one is refused if it turns up later.

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

    def check_known(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._seen

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
    refused: set[int] = field(default_factory=set)  # seq_ids answered 4xx, never registered
    moved: float = field(default_factory=time.monotonic)  # when next_seq last advanced


class GapTimeout(UserError):
    """A request held for a lower ``seq_id`` that never arrived."""


class Sequencer:
    """The reorder buffers of all models, plus their idempotency record."""

    def __init__(self, *, max_ahead: int = MAX_AHEAD) -> None:
        self.max_ahead = max_ahead
        self.seen = Idempotency()
        self._models: dict[str, _Model] = {}
        self._lock = threading.RLock()

    def held_count(self) -> int:
        """Requests held now, over every model, for a lower ``seq_id`` (``/metrics``)."""
        with self._lock:
            return sum(len(m.held) for m in self._models.values())

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
                    f"(next expected: {m.next_seq}); seq_ids must increase, and a seq_id the server "
                    "gave up waiting for cannot be sent later"
                )
            if seq_id in m.held:
                raise BadRequest(f"seq_id {seq_id} of model {model_id} is already queued")
            if seq_id >= m.next_seq + self.max_ahead:  # also bounds how many can be held
                raise BadRequest(
                    f"seq_id {seq_id} of model {model_id} is too far ahead: the next expected is "
                    f"{m.next_seq}, and at most {self.max_ahead} seq_ids past it may wait"
                )
            self.seen.remember((model_id, seq_id), digest, request_id)
            m.refused.discard(seq_id)  # sent again, fixed
            m.held[seq_id] = _Held(start, out)
            self._drain(m)

    def refused(self, model_id: str, seq_id: int) -> None:
        """``seq_id`` of ``model_id`` was answered with an error the SDK does not retry: it will
        never come, so whatever waits for it need not. The caller checked that the model is the
        sender's. A ``seq_id`` already registered (a duplicate refused) is left alone."""
        with self._lock:
            m = self._models.get(model_id)
            if m is None or seq_id < m.next_seq or seq_id in m.held or seq_id >= m.next_seq + self.max_ahead:
                return
            if self.seen.check_known((model_id, seq_id)):
                return
            m.refused.add(seq_id)
            self._drain(m)

    def awaited(self, model_id: str, seq_id: int) -> bool:
        """Is ``seq_id`` the one ``model_id``'s held requests wait for?"""
        with self._lock:
            m = self._models.get(model_id)
            return m is not None and seq_id == m.next_seq and bool(m.held)

    def _drain(self, m: _Model) -> None:
        while True:
            if m.next_seq in m.held:
                held = m.held.pop(m.next_seq)
            elif m.next_seq in m.refused and m.held:  # only skipped once something waits for it
                m.refused.discard(m.next_seq)
                held = None
            else:
                return
            m.next_seq += 1
            m.moved = time.monotonic()
            if held is None:
                continue
            try:
                held.start()
            except BaseException as e:  # a refused request fails alone; the order goes on
                fail(held.out, e)

    def skip_gaps(self, gap_timeout_s: float) -> int:
        """Give up on missing ``seq_id``s a model has waited for longer than ``gap_timeout_s``:
        the requests held right behind each gap fail, naming it, and the model goes on. Returns how
        many requests failed."""
        now = time.monotonic()
        failed = 0
        with self._lock:
            for model_id, m in self._models.items():
                if not m.held:
                    continue
                waited = now - max(m.moved, min(h.since for h in m.held.values()))
                if waited <= gap_timeout_s:
                    continue
                first = min(m.held)
                missing = _span(m.next_seq, first - 1)
                log.warning("model %s: %s never arrived; failing the requests behind it", model_id, missing)
                m.refused = {s for s in m.refused if s >= first}
                m.next_seq = first
                while m.next_seq in m.held:  # the run right behind the gap: each waited for it
                    held = m.held.pop(m.next_seq)
                    fail(
                        held.out,
                        GapTimeout(
                            f"seq_id {m.next_seq} of model {model_id} was not run: it waited "
                            f"{waited:.1f} s for {missing}, which never arrived (a send that was "
                            "lost or failed); running it out of order could change what it computes. "
                            "The model's later requests run as usual"
                        ),
                    )
                    m.next_seq += 1
                    failed += 1
                m.moved = now
                self._drain(m)
        return failed

    def close(self, model_id: str, reason: str) -> None:
        """Forget a model; requests still held for it fail with ``reason``."""
        with self._lock:
            m = self._models.pop(model_id, None)
        if m is not None:
            for held in m.held.values():
                fail(held.out, UserError(reason))


def _span(lo: int, hi: int) -> str:
    return f"seq_id {lo}" if lo == hi else f"seq_ids {lo}..{hi}"
