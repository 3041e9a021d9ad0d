"""Rollout workers as Ray actors: the pool's Ray transport (:class:`RayTransport`).

Each worker is a :class:`RolloutActor`, a threaded Ray actor hosting the transport-free
:class:`~opentinker.workers.worker.WorkerCore` with the same :mod:`~opentinker.workers.wire`
messages as a worker process. Its loop thread runs what the process worker's main loop runs:
take every waiting message, run one tick, queue the replies. Two actor methods carry the
messages: ``send(seq, msgs)`` (numbered by the pool's side, applied in that order whatever order
the actor's threads run them in) and ``replies(timeout)``, a long poll.

The pool's side is :class:`RayWorker`, one per actor: its reader thread long-polls ``replies``
and writes each reply into a local pipe, whose read end is the handle's ``conn``, so the pool's
dispatcher waits on Ray workers exactly as on processes. When the actor dies (``ray.kill``, its
node lost, out of memory) the poll raises, the reader closes the pipe, and the pool re-runs that
worker's requests elsewhere and starts a new actor in its place.

**Snapshot handoff** goes through Ray's object store: :meth:`RayTransport.payload` serializes a
version's LoRA tensors to safetensors bytes and ``ray.put``\\s them once; every worker's
``Publish`` carries the ``ObjectRef``, and the actor fetches the bytes from the store before it
registers the snapshot. The pool keeps the reference while any worker may need the version, and
drops it when it retires the version, which frees the object.

Actors are named ``opentinker-rollout-<pool>-<worker>-<n>`` in the ``opentinker`` namespace
(``ray.get_actor(name, namespace="opentinker")`` finds one) and ask for ``cpus`` CPUs and
``gpus`` GPUs each; a request the cluster cannot meet is refused before any actor is created
(:func:`~opentinker.cluster.ray_env.check_fits`); an actor Ray has not placed within the
placement timeout (:func:`~opentinker.cluster.ray_env.wait_placed`), or not started within the
start-up timeout, is killed, its worker's start failing with the reason.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing as mp
import pickle
import re
import threading
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError

from opentinker.cluster.ray_env import (
    NAMESPACE,
    PLACEMENT_TIMEOUT_S,
    Ask,
    ClusterError,
    check_fits,
    resources,
    wait_placed,
)
from opentinker.lora import LoRAWeights
from opentinker.workers.process import WorkerDied, WorkerStartError
from opentinker.workers.wire import (
    Done,
    Inbound,
    LoRABytes,
    Outbound,
    Publish,
    Ready,
    Stop,
    WorkerOptions,
    to_bytes,
)

log = logging.getLogger(__name__)

POLL_S = 0.5  # one long poll of an actor's replies
GATHER_S, MAX_GATHER_S = 0.002, 0.02  # an idle worker gathers requests sent together (as a process does)
ACTOR_THREADS = 4  # the actor's method threads: sends, polls and the handshake run at once


class RolloutActor:
    """A rollout worker inside a Ray actor (see the module docstring)."""

    def __init__(self, index: int, options: WorkerOptions) -> None:
        import torch

        from opentinker.workers.worker import WorkerCore

        torch.set_num_threads(int(options.threads or 1))
        self.core = WorkerCore(index, options)
        self._cv = threading.Condition()
        self._inbox: list[Inbound] = []
        self._early: dict[int, list[Inbound]] = {}  # sends that overtook an earlier one
        self._next = 0
        self._out: list[Outbound] = []
        self._stopped = False
        self._thread = threading.Thread(
            target=self._run, name=f"opentinker-rollout-actor-{index}", daemon=True
        )
        self._thread.start()

    def ready(self) -> Ready:
        return self.core.ready()

    def send(self, seq: int, msgs: list[Inbound]) -> None:
        resolved: list[Inbound] = []
        for m in msgs:
            try:
                resolved.append(_resolve(m))
            except Exception as e:  # the bytes could not be fetched: the snapshot never registers
                log.warning("rollout actor could not fetch a snapshot: %s", e)
        with self._cv:
            self._early[seq] = resolved
            while self._next in self._early:
                self._inbox += self._early.pop(self._next)
                self._next += 1
            self._cv.notify_all()

    def replies(self, timeout: float) -> list[Outbound]:
        with self._cv:
            if not self._out:
                self._cv.wait(timeout)
            out, self._out = self._out, []
        return [_sendable(m) for m in out]

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self.core.busy and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                idle = not self.core.busy
            if idle:  # requests sent together prefill together
                deadline, seen = time.perf_counter() + MAX_GATHER_S, -1
                while time.perf_counter() < deadline:
                    with self._cv:
                        n = len(self._inbox)
                    if n == seen:
                        break
                    seen = n
                    time.sleep(GATHER_S)
            with self._cv:
                msgs, self._inbox = self._inbox, []
            out: list[Outbound] = []
            for m in msgs:
                if isinstance(m, Stop):
                    with self._cv:
                        self._stopped = True
                    return
                out += self.core.handle(m)
            if self.core.busy:
                out += self.core.tick()
            if out:
                with self._cv:
                    self._out += out
                    self._cv.notify_all()


def _resolve(msg: Inbound) -> Inbound:
    """A ``Publish`` whose data is an object reference, with the bytes fetched from the store."""
    if isinstance(msg, Publish) and not isinstance(msg.weights.data, bytes | bytearray | memoryview):
        return Publish(msg.policy_id, LoRABytes(msg.weights.config, bytes(ray.get(msg.weights.data))))
    return msg


def _sendable(msg: Outbound) -> Outbound:
    """A reply whose error cannot be pickled carries the error's text instead."""
    if isinstance(msg, Done) and msg.error is not None:
        try:
            pickle.dumps(msg.error)
        except Exception:
            return Done(msg.rid, error=RuntimeError(f"{type(msg.error).__name__}: {msg.error}"))
    return msg


_actor_class: Any = None


def actor_class() -> Any:
    global _actor_class
    if _actor_class is None:
        _actor_class = ray.remote(RolloutActor)
    return _actor_class


class RayTransport:
    """Rollout workers as Ray actors of ``cpus`` CPUs and ``gpus`` GPUs each."""

    name = "ray"

    def __init__(
        self, cpus: float = 1.0, gpus: float = 0.0, placement_timeout: float = PLACEMENT_TIMEOUT_S
    ) -> None:
        if not cpus >= 0 or not gpus >= 0 or cpus + gpus <= 0:
            raise ValueError(f"a rollout worker needs CPUs or GPUs, got cpus={cpus!r}, gpus={gpus!r}")
        self.cpus, self.gpus = float(cpus), float(gpus)
        self.placement_timeout = placement_timeout
        self.tag = uuid.uuid4().hex[:8]  # names this pool's actors
        self.generation = itertools.count()
        self.puts = 0  # snapshots put in the object store

    def worker(self, index: int, options: WorkerOptions, startup_timeout: float) -> RayWorker:
        device = "cuda" if self.gpus > 0 else options.device
        options = dataclasses.replace(options, threads=max(1, int(self.cpus)), device=device)
        return RayWorker(index, options, self, startup_timeout)

    def payload(self, weights: LoRAWeights) -> LoRABytes:
        config, data = to_bytes(weights)
        self.puts += 1
        return LoRABytes(config, ray.put(data))

    def check_capacity(self, workers: int) -> None:
        check_fits(workers, self.cpus, self.gpus)


class RayWorker:
    """The pool's handle on one rollout actor (see the module docstring)."""

    def __init__(
        self, index: int, options: WorkerOptions, transport: RayTransport, startup_timeout: float
    ) -> None:
        self.index = index
        self.options = options
        self.transport = transport
        self.startup_timeout = startup_timeout
        self.name = f"opentinker-rollout-{transport.tag}-{index}-{next(transport.generation)}"
        self.actor: Any = None
        self.ready: Ready | None = None
        self.conn: Connection | None = None
        self._w: Connection | None = None
        self._seq = itertools.count()
        self._send_lock = threading.Lock()
        self._gone = threading.Event()
        self._why = "its actor is gone"

    @property
    def pid(self) -> int | None:
        return None if self.ready is None else self.ready.pid

    @property
    def sentinel(self) -> Any:
        return None  # a lost actor shows as its reply pipe closing

    def start(self) -> Ready:
        """Create the actor and wait for its handshake; raises :class:`WorkerStartError`."""
        t = self.transport
        self.actor = (
            actor_class()
            .options(
                name=self.name,
                namespace=NAMESPACE,
                num_cpus=t.cpus,
                num_gpus=t.gpus,
                max_concurrency=ACTOR_THREADS,
                max_restarts=0,
            )
            .remote(self.index, self.options)
        )
        try:
            each = Ask(1, t.cpus, t.gpus, "rollout worker", "--worker")
            wait_placed({f"rollout worker {self.index}": self.actor}, each, t.placement_timeout)
        except ClusterError as e:
            self.kill()
            raise WorkerStartError(str(e)) from None
        try:
            ready: Ready = ray.get(self.actor.ready.remote(), timeout=self.startup_timeout)
        except GetTimeoutError:
            self.kill()
            have = resources()
            raise WorkerStartError(
                f"rollout worker {self.index} was not placed and started within "
                f"{self.startup_timeout:.0f} s (it asks for {t.cpus:g} CPUs and {t.gpus:g} GPUs; "
                f"the cluster has {have['free'].get('CPU', 0.0):g} CPUs and "
                f"{have['free'].get('GPU', 0.0):g} GPUs free)"
            ) from None
        except RayError as e:
            self.kill()
            raise WorkerStartError(f"rollout worker {self.index} could not start: {_cause(e)}") from None
        self.ready = ready
        self.conn, self._w = mp.Pipe(duplex=False)
        threading.Thread(target=self._read, name=f"opentinker-ray-reader-{self.index}", daemon=True).start()
        return ready

    def _read(self) -> None:
        try:
            while not self._gone.is_set():
                for m in ray.get(self.actor.replies.remote(POLL_S)):
                    assert self._w is not None
                    self._w.send(m)
        except Exception as e:
            if not self._gone.is_set():
                self._why = f"its actor is gone ({type(e).__name__})"
        finally:
            self._gone.set()
            if self._w is not None:
                self._w.close()  # the pool's recv sees the end

    def send(self, msg: Inbound) -> None:
        if self.actor is None or self._gone.is_set():
            raise WorkerDied(f"rollout worker {self.index}: {self._why}")
        with self._send_lock:
            self.actor.send.remote(next(self._seq), [msg])

    def recv(self) -> Outbound:
        if self.conn is None:
            raise WorkerDied(f"rollout worker {self.index} is not running")
        try:
            return self.conn.recv()
        except (OSError, EOFError):
            raise WorkerDied(f"rollout worker {self.index}: {self._why}") from None

    def alive(self) -> bool:
        return self.actor is not None and not self._gone.is_set()

    def stop(self, timeout: float = 10.0) -> None:
        self.kill()

    def kill(self) -> None:
        """End the actor now. The reply pipe's read end stays open for the pool's dispatcher,
        which may be waiting on it; it reads the end of the pipe and drops the worker."""
        self._gone.set()
        if self.actor is not None:
            try:
                ray.kill(self.actor, no_restart=True)
            except Exception as e:  # already gone
                log.debug("ray.kill of %s: %s", self.name, e)


def _cause(e: BaseException) -> str:
    """The error an actor's creation raised (the last ``SomeError: message`` line Ray reports)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    found = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit): ", ln)]
    return found[-1] if found else lines[-1] if lines else type(e).__name__
