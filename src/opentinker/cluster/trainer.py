"""A pool of trainer workers on Ray, and the routing of every model to the worker that holds it.

``TrainerPool(base_model, workers=N)`` starts N :class:`~opentinker.cluster.trainer_worker.TrainerWorker`
actors (each ``worker_cpus`` CPUs and ``worker_gpus`` GPUs), waits until every one has loaded its
base-model replica, and joins them in one ``torch.distributed`` process group (for data-parallel
models, :mod:`opentinker.cluster.dp`). A request Ray cannot meet (more CPUs or GPUs than the
cluster has) is refused before any actor starts.

Placement: a new model goes to the live worker holding the fewest models (ties: the fewest
requests in flight, then the lowest rank). A model never moves while it has requests in flight: it
stays where it was created until it is deleted or its worker is lost.

Worker loss: a request to a dead worker, or one in flight when it dies, raises
:class:`WorkerLostError` naming the worker and the model, at once (Ray reports the actor's death
to every pending call); the model's later requests raise it too, never hang. ``restore`` puts the
model back from a checkpoint (weights and optimizer state, on storage every worker reads) onto a
live worker, under the same model id (``RoutedScheduler.restore``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from opentinker.cluster.trainer_worker import TrainerWorker
from opentinker.engine import EngineError
from opentinker.models.registry import canonical_name


class WorkerLostError(EngineError):
    """The trainer worker that held a model is gone; the model's unsaved steps went with it."""


class ClusterConfigError(ValueError):
    """A pool the Ray cluster cannot run (resources it lacks, a worker count below one)."""


@dataclass
class WorkerSlot:
    """The driver's view of one trainer worker."""

    rank: int
    worker_id: str
    actor: Any  # the Ray actor handle
    alive: bool = True
    models: set[str] = field(default_factory=set)
    in_flight: int = 0
    lost_reason: str = ""


def ray_module() -> Any:
    try:
        import ray
    except ImportError as e:  # pragma: no cover - the ray extra is what brings it
        raise ClusterConfigError("Ray is not installed: pip install 'opentinker[ray]'") from e
    if not ray.is_initialized():
        raise ClusterConfigError("Ray is not initialised: call ray.init(...) (or serve --ray) first")
    return ray


def start_local_ray() -> None:
    """Start a local Ray instance unless this process is already connected to one."""
    try:
        import ray
    except ImportError as e:
        raise ClusterConfigError("Ray is not installed: pip install 'opentinker[ray]'") from e
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)


def check_resources(workers: int, worker_cpus: float, worker_gpus: float) -> None:
    """Refuse, naming the shortfall, a pool the cluster cannot place (nothing is started)."""
    ray = ray_module()
    if not isinstance(workers, int) or workers < 1:
        raise ClusterConfigError(f"a trainer pool needs at least one worker, got {workers!r}")
    if worker_cpus < 0 or worker_gpus < 0:
        raise ClusterConfigError(f"worker resources must be >= 0, got cpus={worker_cpus}, gpus={worker_gpus}")
    have = ray.cluster_resources()
    for name, each in (("CPU", worker_cpus), ("GPU", worker_gpus)):
        need, total = workers * each, float(have.get(name, 0.0))
        if need > total + 1e-9:
            raise ClusterConfigError(
                f"{workers} trainer workers x {each:g} {name} = {need:g} {name}, "
                f"but the Ray cluster has {total:g} {name}"
            )


class TrainerPool:
    """N trainer workers for one base model, and the model -> worker routing (module docstring)."""

    def __init__(
        self,
        base_model: str,
        workers: int,
        *,
        worker_cpus: float = 1.0,
        worker_gpus: float = 0.0,
        device: str | None = None,
        max_rank: int = 128,
        max_concurrency: int = 256,
    ) -> None:
        ray = ray_module()
        check_resources(workers, worker_cpus, worker_gpus)
        self.base_model = canonical_name(base_model)
        self.device = device or ("cuda" if worker_gpus > 0 else "cpu")
        cls = ray.remote(TrainerWorker).options(
            num_cpus=worker_cpus, num_gpus=worker_gpus, max_concurrency=max_concurrency, max_restarts=0
        )
        threads = max(1, int(worker_cpus))
        self.workers = [
            WorkerSlot(
                r,
                f"trainer-{r}",
                cls.remote(
                    self.base_model,
                    worker_id=f"trainer-{r}",
                    device=self.device,
                    max_rank=max_rank,
                    threads=threads,
                ),
            )
            for r in range(workers)
        ]
        self._lock = threading.RLock()
        self._placement: dict[str, WorkerSlot] = {}
        self.group_lock = threading.Lock()  # process groups are formed by all workers, in one order
        try:
            infos = ray.get([w.actor.info.remote() for w in self.workers])
            address, port = ray.get(self.workers[0].actor.rendezvous.remote())
            ray.get([w.actor.join_pool.remote(address, port, w.rank, workers) for w in self.workers])
        except Exception:
            self.shutdown()
            raise

        self.limits: dict[str, int] = infos[0]["limits"]  # what a request is checked against

    # ------------------------------------------------------------------ placement
    def reserve(self, model_id: str, slots: list[WorkerSlot]) -> None:
        """Count ``model_id`` (a data-parallel model, routed by itself) on each of ``slots``."""
        with self._lock:
            if model_id in self._placement or any(model_id in w.models for w in self.workers):
                raise EngineError(f"model {model_id!r} already exists")
            for w in slots:
                w.models.add(model_id)

    def release(self, model_id: str, slots: list[WorkerSlot]) -> None:
        with self._lock:
            for w in slots:
                w.models.discard(model_id)

    def worker_of(self, model_id: str) -> WorkerSlot:
        """The live worker holding ``model_id``; a lost one raises :class:`WorkerLostError`."""
        with self._lock:
            slot = self._placement.get(model_id)
        if slot is None:
            raise EngineError(f"unknown model {model_id!r}")
        if not slot.alive:
            raise WorkerLostError(
                f"trainer worker {slot.worker_id} was lost ({slot.lost_reason}) with model {model_id!r}; "
                "restore it from its newest checkpoint"
            )
        return slot

    def live_workers(self) -> list[WorkerSlot]:
        with self._lock:
            return [w for w in self.workers if w.alive]

    def least_loaded(self, exclude: set[int] | None = None) -> WorkerSlot:
        with self._lock:
            live = [w for w in self.workers if w.alive and w.rank not in (exclude or set())]
            if not live:
                raise WorkerLostError("no live trainer worker is left")
            return min(live, key=lambda w: (len(w.models), w.in_flight, w.rank))

    def placement(self) -> dict[str, str]:
        """model id -> worker id, for every placed model."""
        with self._lock:
            return {m: w.worker_id for m, w in self._placement.items()}

    def place(self, model_id: str) -> WorkerSlot:
        """Choose the worker of new model ``model_id``: the least loaded live one (it stays there)."""
        with self._lock:
            if model_id in self._placement:
                raise EngineError(f"model {model_id!r} already exists")
            slot = self.least_loaded()
            self._placement[model_id] = slot
            slot.models.add(model_id)
            return slot

    def is_placed(self, ref: str | None) -> bool:
        with self._lock:
            return ref is not None and ref in self._placement

    def move_lost(self, model_id: str) -> tuple[WorkerSlot, WorkerSlot | None]:
        """Place ``model_id``, whose worker was lost, on the least-loaded live worker; returns the
        new slot and the old one (for :meth:`undo_move`)."""
        with self._lock:
            old = self._placement.get(model_id)
            if old is not None and old.alive:
                raise EngineError(f"model {model_id!r} is live on {old.worker_id}; nothing to restore")
            slot = self.least_loaded()
            self._placement[model_id] = slot
            slot.models.add(model_id)
            if old is not None:
                old.models.discard(model_id)
            return slot, old

    def undo_move(self, model_id: str, slot: WorkerSlot, old: WorkerSlot | None) -> None:
        with self._lock:
            slot.models.discard(model_id)
            if old is None:
                self._placement.pop(model_id, None)
            else:
                self._placement[model_id] = old
                old.models.add(model_id)

    def forget(self, model_id: str) -> None:
        with self._lock:
            slot = self._placement.pop(model_id, None)
            if slot is not None:
                slot.models.discard(model_id)

    def get(self, slot: WorkerSlot, model_id: str, ref: Any) -> Any:
        """``ray.get`` of one call on ``slot``, with Ray's errors turned into ours."""
        ray = ray_module()
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as e:  # the actor raised: the cause is the engine's error
            cause = e.cause if isinstance(e.cause, BaseException) else e
            raise cause from None
        except ray.exceptions.RayActorError as e:
            self.mark_lost(slot, type(e).__name__)
            raise WorkerLostError(
                f"trainer worker {slot.worker_id} was lost while serving model {model_id!r}; "
                "restore it from its newest checkpoint"
            ) from None

    def mark_lost(self, slot: WorkerSlot, reason: str) -> None:
        with self._lock:
            slot.alive = False
            slot.lost_reason = reason or slot.lost_reason

    def kill_worker(self, rank: int) -> None:
        """Kill one worker's actor at once (what a crashed node does; the tests' fault)."""
        ray_module().kill(self.workers[rank].actor, no_restart=True)

    def shutdown(self) -> None:
        """Kill every worker's actor (nothing to do once Ray itself is shut down)."""
        import ray

        if not ray.is_initialized():
            return
        for w in self.workers:
            if w.alive:
                ray.kill(w.actor, no_restart=True)
                w.alive = False
