"""The rollout worker pool: sampling served by N worker processes, each with its own base model.

:class:`WorkerPool` has the in-process :class:`~opentinker.sampling.loop.SamplingLoop`'s face
(``submit`` → a :class:`~opentinker.sampling.handles.SampleHandle`; ``state``, ``cancel``,
``abort`` of a handle; ``shutdown``; the bookkeeping is the shared
:class:`~opentinker.sampling.handles.RequestBook`), so the scheduler hands it samples the same way. One dispatcher thread owns every worker's pipe.

**Streams and aborts.** A streamed request's tokens come back from its worker as
:class:`~opentinker.workers.wire.Tokens` messages while it decodes, and the dispatcher hands them
to the request's sink (its ``TokenSink`` crossed to the worker as a bare marker). ``abort`` of a
request on a worker fails its future at once and sends that worker an
:class:`~opentinker.workers.wire.Abort`: its rows leave the worker's running batch before its next
decode step. Each worker reports its running batch when it changes
(:class:`~opentinker.workers.wire.Rows`: rows, waiting, aborted), summed in :attr:`WorkerPool.stats`.

**Pinning** happens here, on the submitter's thread, exactly as in process: the request is
validated and its policy resolved to the engine's snapshot weights (unknown, retired or live
adapters get the in-process errors at once, and never reach a worker). The request then holds
those weights until it is answered, whatever is published or retired meanwhile.

**Snapshot handoff.** A worker gets a snapshot's LoRA tensors (safetensors bytes,
:mod:`~opentinker.workers.wire`) the first time a request routed to it needs them: once per
worker per version, sent on the same pipe ahead of the request, so the worker registers them
before it reads the request. A worker that joins late or restarts holds nothing and receives what
its requests need. When the engine no longer serves a version (released, or its id reused for
other weights) and no request holds it, the pool sends ``Retire`` to every worker holding it.

**Routing.** A request goes to the worker holding its prefix (a sequence it finished under the
same policy, which the next turn of a conversation extends) when that worker has room; otherwise
to the ready worker with the fewest outstanding rows. A request that finds no room waits in the
pool (``held_back``) until rows free up.

**Faults.** A worker whose process ends (``kill -9``) or whose pipe breaks: its in-flight
requests go back to the front of the queue and run on another worker (or on it again once it is
back); a reply is accepted only from the worker a request is assigned to, so every future
resolves exactly once. If no worker is left and none can start, the waiting requests fail with
the cause. Restarting the dead worker, and scaling, are the worker lifecycle's
(:mod:`~opentinker.workers.lifecycle`, mixed into :class:`WorkerPool`).

**Transports.** The pool drives its workers through a
:class:`~opentinker.workers.transport.Transport`: processes on this machine by default, Ray
actors anywhere in a cluster with ``opentinker.cluster.ray_rollout.RayTransport``. Routing,
handoff, faults and scaling are the same for both.

**Scaling.** :meth:`WorkerPool.scale` changes the number of serving workers while requests run
(:mod:`~opentinker.workers.lifecycle`): new workers serve the current snapshots on first use, a
removed one drains first.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing as mp
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from typing import Any

from opentinker.engine import Engine
from opentinker.lora import LoRAWeights
from opentinker.sampling.decoder import MIN_SHARED_PREFIX, Pinned
from opentinker.sampling.handles import RequestBook, SampleState
from opentinker.sampling.types import SampleRequest, SamplingParams, TokenSink
from opentinker.workers.lifecycle import WorkerLifecycle
from opentinker.workers.process import WorkerDied, WorkerStartError
from opentinker.workers.slots import PoolStats, Req, Slot, start_all
from opentinker.workers.transport import ProcessTransport, Transport
from opentinker.workers.wire import (
    Abort,
    Done,
    Failed,
    LoRABytes,
    Publish,
    Published,
    Ready,
    Retire,
    Rows,
    Sample,
    Tokens,
    WorkerOptions,
)

log = logging.getLogger(__name__)

PREFIXES_PER_POLICY = 256  # finished sequences remembered per policy for prefix-aware routing
SWEEP_S = 0.5  # how often versions the engine no longer serves are retired from the workers


class WorkerPool(RequestBook[Req], WorkerLifecycle):
    """Sampling served by worker processes (or actors): the module docstring."""

    what = "the rollout worker pool"

    def __init__(
        self,
        engine: Engine,
        pin: Callable[[SampleRequest], Pinned],
        workers: int,
        options: WorkerOptions,
        *,
        startup_timeout: float = 300.0,
        transport: Transport | None = None,
    ) -> None:
        """Start ``workers`` workers (processes unless ``transport`` says otherwise) and wait for
        each one's handshake; a worker that cannot start raises
        :class:`~opentinker.workers.process.WorkerStartError` (the others are stopped), a
        transport that cannot place them raises ``ValueError``. ``pin`` validates a request and
        resolves its weights (the in-process rules)."""
        if workers < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {workers}")
        self.transport: Transport = transport or ProcessTransport()
        self.transport.check_capacity(workers)
        self.engine = engine
        self.pin = pin
        self.max_rows = options.max_rows
        self.startup_timeout = startup_timeout
        self.options = options
        self.prefix_routing = options.prefix_cache_bytes > 0
        super().__init__()
        self._slots: list[Slot] = []
        self._inbox: deque[Req] = deque()
        self._pending: deque[Req] = deque()  # waiting for room on a worker
        self._publishing: list[tuple[str, Pinned]] = []  # handoffs ahead of use (publish)
        self._wire: dict[int, tuple[str, str | None, LoRAWeights]] = {}  # weights uid -> wire, policy, w
        self._bytes: dict[str, LoRABytes] = {}  # wire id -> its handoff payload
        self._prefixes: dict[str | None, OrderedDict[tuple[int, ...], int]] = {}
        self._rerun = self._published = self._retired = self._prefix_routed = 0
        self._last_sweep = 0.0
        self._scaling = threading.Lock()  # one scale at a time
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self.ready: list[Ready] = []
        handles = [self.transport.worker(i, self.options, startup_timeout) for i in range(workers)]
        self.ready = start_all(handles)
        self._slots = [Slot(i, h, "ready") for i, h in enumerate(handles)]
        self._thread = threading.Thread(target=self._loop, name="opentinker-rollout-pool", daemon=True)
        self._thread.start()
        atexit.register(_stop_at_exit, weakref.ref(self))

    # ------------------------------------------------------------------ the request book's hooks
    def _pin(self, req: SampleRequest) -> Pinned:
        return self.pin(req)

    def _enqueue(self, rid: int, pinned: Pinned, future: Future) -> Req:
        r = Req(rid, pinned, future, self._wire_id(pinned))
        self._inbox.append(r)
        return r

    @staticmethod
    def _future(entry: Req) -> Future:
        return entry.future

    def _where(self, rid: int) -> SampleState:
        """``queued``: not yet seen by the dispatcher; ``held_back``: no worker has room."""
        if any(r.rid == rid for r in self._inbox):
            return "queued"
        return "held_back" if any(r.rid == rid for r in self._pending) else "taken"

    def _unqueue(self, rid: int) -> bool:
        for q in (self._inbox, self._pending):
            for r in q:
                if r.rid == rid:
                    q.remove(r)
                    return True
        return False

    def _stop(self, rid: int) -> None:
        """The worker decoding it gets an :class:`~opentinker.workers.wire.Abort`: its rows leave
        that worker's running batch before its next decode step."""
        slot = next((s for s in self._slots if rid in s.inflight), None)
        if slot is None:
            return
        del slot.inflight[rid]
        if slot.handle is not None and slot.state in ("ready", "draining"):
            try:
                slot.handle.send(Abort(rid))
            except WorkerDied as e:
                self._died(slot, str(e))
        self._finish_drain(slot)

    def _woken(self) -> None:
        self._wake()

    # ------------------------------------------------------------------ the service's face
    def follow(self, group: str, policy_id: str) -> None:
        """Nothing: a worker's rows finish on the weights they started with."""

    def shutdown(self) -> None:
        with self._lock:
            if self._stopped:
                return
            slots = list(self._slots)
            left = self._close()
            self._inbox.clear()
            self._pending.clear()
        self._wake()
        if threading.current_thread() is not getattr(self, "_thread", None):
            self._thread.join(timeout=30)
        for s in slots:
            if s.handle is not None:
                s.handle.stop()
        err = RuntimeError("the rollout worker pool was shut down")
        for r in left:
            if not r.future.done():
                r.future.set_exception(err)

    def publish(self, policy: str, timeout: float = 60.0) -> float:
        """Hand snapshot ``policy`` to every serving worker that lacks it now, ahead of its first
        request (requests do this on first use anyway); returns the seconds until every one has
        acknowledged it whole. Raises ``EngineError`` for a policy that is no snapshot."""
        pinned = self.pin(SampleRequest(policy, [0], SamplingParams(max_tokens=1)))
        t = time.perf_counter()
        with self._lock:
            wire = self._wire_id(pinned)
            assert wire is not None
            # held by a request-like entry until acknowledged, so no sweep retires it meanwhile
            entry = (wire, pinned)
            self._publishing.append(entry)
        self._wake()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(wire in s.acked for s in self._slots if s.state == "ready"):
                    self._publishing = [e for e in self._publishing if e is not entry]
                    return time.perf_counter() - t
            time.sleep(0.0005)
        raise TimeoutError(f"rollout workers did not acknowledge {policy!r} within {timeout:.0f} s")

    # ------------------------------------------------------------------ counters
    @property
    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                [s.served for s in self._slots],
                [s.restarts for s in self._slots],
                self._rerun,
                self._published,
                self._retired,
                self._prefix_routed,
                sum(s.batch.live_rows for s in self._slots),
                len(self._inbox) + len(self._pending) + sum(s.batch.waiting for s in self._slots),
                sum(s.batch.steps for s in self._slots),
                sum(s.batch.aborted for s in self._slots),
            )

    # ------------------------------------------------------------------ dispatcher
    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send_bytes(b"")

    def _wire_id(self, pinned: Pinned) -> str | None:
        w = pinned.weights
        if w is None:
            return None
        hit = self._wire.get(w.uid)
        if hit is None:
            hit = (f"{pinned.req.policy}#{w.uid}", pinned.req.policy, w)
            self._wire[w.uid] = hit
        return hit[0]

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._stopped:
                    return
                conns: list[Any] = [self._wake_r]
                owner: dict[Any, Slot] = {}
                for s in self._slots:
                    if (
                        s.state in ("ready", "draining")
                        and s.handle is not None
                        and s.handle.conn is not None
                    ):
                        conns.append(s.handle.conn)
                        owner[s.handle.conn] = s
                        sentinel = s.handle.sentinel
                        if sentinel is not None:
                            conns.append(sentinel)
                            owner[sentinel] = s
            ready = wait(conns, timeout=SWEEP_S)
            with self._lock:
                if self._stopped:
                    return
                for c in ready:
                    if c is self._wake_r:
                        while self._wake_r.poll():
                            self._wake_r.recv_bytes()
                        continue
                    slot = owner[c]
                    if slot.state not in ("ready", "draining"):
                        continue
                    if isinstance(c, Connection):
                        self._read(slot)
                    elif not slot.handle or not slot.handle.alive():
                        self._died(slot, "its process ended")
                while self._inbox:
                    self._pending.append(self._inbox.popleft())
                self._dispatch()
                if time.monotonic() - self._last_sweep > SWEEP_S:
                    self._sweep()
                self._fail_if_none_left()

    def _read(self, slot: Slot) -> None:
        assert slot.handle is not None and slot.handle.conn is not None
        try:
            while slot.handle.conn.poll(0):
                msg = slot.handle.recv()
                if isinstance(msg, Tokens):
                    r = slot.inflight.get(msg.rid)
                    if r is not None and r.pinned.req.stream is not None:
                        _deliver(r.pinned.req.stream, msg)
                elif isinstance(msg, Done):
                    self._answer(slot, msg)
                elif isinstance(msg, Rows):
                    slot.batch = msg
                elif isinstance(msg, Published):
                    slot.acked.add(msg.policy_id)
        except WorkerDied as e:
            self._died(slot, str(e))
        self._finish_drain(slot)

    def _answer(self, slot: Slot, d: Done) -> None:
        r = slot.inflight.pop(d.rid, None)
        if r is None or self._answered(d.rid) is None:
            return  # not this worker's (it was re-run elsewhere) or already answered
        slot.served += 1
        if d.error is not None:
            r.future.set_exception(d.error)
            return
        assert d.result is not None
        if self.prefix_routing:
            seen = self._prefixes.setdefault(r.wire, OrderedDict())
            prompt = r.pinned.req.prompt
            for seq in d.result.sequences:
                seen[tuple(prompt + seq.tokens[:-1])] = slot.index
                seen.move_to_end(tuple(prompt + seq.tokens[:-1]))
            while len(seen) > PREFIXES_PER_POLICY:
                seen.popitem(last=False)
        r.future.set_result(d.result)

    def _route(self, r: Req, ready: list[Slot]) -> Slot | None:
        room = [s for s in ready if s.rows == 0 or s.rows + r.rows <= self.max_rows]
        if not room:
            return None
        seen = self._prefixes.get(r.wire) if self.prefix_routing else None
        if seen:
            prompt, best, holder = r.pinned.req.prompt, MIN_SHARED_PREFIX - 1, None
            for tokens, index in seen.items():
                n = len(tokens)
                if n > best and n <= len(prompt) and tuple(prompt[:n]) == tokens:
                    best, holder = n, index
            chosen = next((s for s in room if s.index == holder), None)
            if chosen is not None:
                self._prefix_routed += 1
                return chosen
        return min(room, key=lambda s: (s.rows, len(s.inflight), s.index))

    def _dispatch(self) -> None:
        ready = [s for s in self._slots if s.state == "ready"]
        for wire, pinned in self._publishing:
            for slot in ready:
                if wire not in slot.published:
                    try:
                        self._send_publish(slot, wire, pinned)
                    except WorkerDied as e:
                        self._died(slot, str(e))
        ready = [s for s in self._slots if s.state == "ready"]
        kept: deque[Req] = deque()
        while self._pending:
            r = self._pending.popleft()
            slot = self._route(r, ready) if ready else None
            if slot is None:
                kept.append(r)
                continue
            try:
                if r.wire is not None and r.wire not in slot.published:
                    self._send_publish(slot, r.wire, r.pinned)
                req = r.pinned.req
                wire_req = req if r.wire is None else _renamed(req, r.wire)
                slot.handle.send(Sample(r.rid, wire_req))  # type: ignore[union-attr]
                r.worker = slot.index
                slot.inflight[r.rid] = r
            except WorkerDied as e:
                kept.append(r)
                self._died(slot, str(e))
                ready = [s for s in self._slots if s.state == "ready"]
        self._pending = kept

    def _send_publish(self, slot: Slot, wire: str, pinned: Pinned) -> None:
        """Send ``wire``'s tensors to ``slot`` (serialized once per version, for all workers)."""
        assert pinned.weights is not None and slot.handle is not None
        payload = self._bytes.get(wire)
        if payload is None:
            payload = self._bytes[wire] = self.transport.payload(pinned.weights)
        slot.handle.send(Publish(wire, payload))
        slot.published.add(wire)
        self._published += 1

    def _sweep(self) -> None:
        """Retire, on every worker, versions the engine no longer serves and no request holds."""
        self._last_sweep = time.monotonic()
        held = {r.wire for r in self._open.values()} | {w for w, _ in self._publishing}
        for uid, (wire, policy, w) in list(self._wire.items()):
            if wire in held or _serves(self.engine, policy, w):
                continue
            del self._wire[uid]
            self._bytes.pop(wire, None)
            self._prefixes.pop(wire, None)
            for s in self._slots:
                if wire in s.published and s.state in ("ready", "draining") and s.handle is not None:
                    try:
                        s.handle.send(Retire(wire))
                        self._retired += 1
                    except WorkerDied as e:
                        self._died(s, str(e))
                s.published.discard(wire)
                s.acked.discard(wire)

    def _fail_if_none_left(self) -> None:
        if not self._pending or any(s.state in ("ready", "starting", "dead") for s in self._slots):
            return
        why = "; ".join(s.error for s in self._slots if s.error) or "no worker is running"
        err = RuntimeError(f"no rollout worker can serve this request: {why}")
        for r in self._pending:
            self._answered(r.rid)
            r.future.set_exception(err)
        self._pending.clear()


def _deliver(sink: TokenSink, piece: Tokens) -> None:
    try:
        sink(piece)
    except Exception:  # a sink's failure is its reader's, never the dispatcher's
        log.exception("a token sink failed")


def _renamed(req: SampleRequest, wire: str) -> SampleRequest:
    from dataclasses import replace

    return replace(req, policy=wire)


def _serves(engine: Engine, policy: str | None, w: LoRAWeights) -> bool:
    try:
        return engine.adapter_weights(policy) is w
    except Exception:
        return False


def _stop_at_exit(ref: weakref.ref) -> None:
    pool = ref()
    if pool is not None:
        pool.shutdown()


__all__ = ["Failed", "PoolStats", "WorkerPool", "WorkerStartError"]
