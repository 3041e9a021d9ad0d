"""How the worker pool reaches its workers: the seam between :class:`~opentinker.workers.pool.WorkerPool`
and a transport.

A transport makes one :class:`WorkerHandle` per worker and encodes a snapshot for the handoff.
A handle starts its worker (raising :class:`~opentinker.workers.process.WorkerStartError` naming
the worker and the cause), sends it :mod:`~opentinker.workers.wire` messages and gives its
replies on :attr:`WorkerHandle.conn`, a readable :class:`~multiprocessing.connection.Connection`
the pool's dispatcher waits on beside every other worker's. A worker that is gone shows as that
connection closing (``recv`` raising :class:`~opentinker.workers.process.WorkerDied`), or as its
:attr:`~WorkerHandle.sentinel` becoming ready where the transport has one (a process).

- :class:`ProcessTransport` (the default): a spawned process behind a pipe, the snapshot's tensors
  sent as safetensors bytes in the :class:`~opentinker.workers.wire.Publish`;
- ``opentinker.cluster.ray_rollout.RayTransport``: a Ray actor, the bytes put once per version in
  Ray's object store and each worker sent the reference.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any, Protocol

from opentinker.lora import LoRAWeights
from opentinker.workers.process import ProcessWorker
from opentinker.workers.wire import Inbound, LoRABytes, Outbound, Ready, WorkerOptions, to_bytes


class WorkerHandle(Protocol):
    index: int
    conn: Connection | None

    @property
    def pid(self) -> int | None: ...

    @property
    def sentinel(self) -> Any: ...

    def start(self) -> Ready: ...

    def send(self, msg: Inbound) -> None: ...

    def recv(self) -> Outbound: ...

    def alive(self) -> bool: ...

    def stop(self, timeout: float = 10.0) -> None: ...

    def kill(self) -> None: ...


class Transport(Protocol):
    name: str

    def worker(self, index: int, options: WorkerOptions, startup_timeout: float) -> WorkerHandle:
        """A handle on worker ``index`` (not started)."""
        ...

    def payload(self, weights: LoRAWeights) -> LoRABytes:
        """A snapshot's config and the data a :class:`~opentinker.workers.wire.Publish` carries;
        the pool makes it once per version and keeps it while any worker may need it."""
        ...

    def check_capacity(self, workers: int) -> None:
        """Raise ``ValueError`` naming the shortfall if ``workers`` more workers cannot be placed."""
        ...


class ProcessTransport:
    """Workers as spawned processes on this machine (:mod:`~opentinker.workers.process`)."""

    name = "process"

    def worker(self, index: int, options: WorkerOptions, startup_timeout: float) -> WorkerHandle:
        return ProcessWorker(index, options, startup_timeout=startup_timeout)

    def payload(self, weights: LoRAWeights) -> LoRABytes:
        return to_bytes(weights)

    def check_capacity(self, workers: int) -> None:
        return None  # a process starts or fails its handshake, naming the cause
