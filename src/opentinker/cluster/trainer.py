"""A pool of trainer workers on Ray, and the routing of every model to the worker that holds it.

``TrainerPool(base_model, workers=N)`` starts N :class:`~opentinker.cluster.trainer_worker.TrainerWorker`
actors (each ``worker_cpus`` CPUs and ``worker_gpus`` GPUs) and waits until every one has loaded
its base-model replica. A request Ray cannot meet (more CPUs or GPUs than the cluster has free)
is refused before any actor starts, and a worker Ray has not placed within ``placement_timeout``
seconds fails the start, naming it, its actors stopped. A data-parallel model (:mod:`opentinker.cluster.dp`) forms a
``torch.distributed`` process group of its own replicas, on any live workers.

Placement: a new model goes to the live worker holding the fewest models (ties: the fewest
requests in flight, then the lowest rank). A model never moves while it has requests in flight: it
stays where it was created until it is deleted or its worker is lost.

Elastic: :meth:`TrainerPool.add_workers` starts more workers (same resources, checked free first;
they join the placement at once, data-parallel models included). :meth:`TrainerPool.choose_leaving`
picks the workers to remove, the least loaded (ties: the newest), preferring those holding no
data-parallel replica; one holding a replica is taken only where each data-parallel model on it
can be made again at its degree on the live workers that stay. It stops placing models on them;
the router hands each of their models over (:mod:`opentinker.cluster.trainer_scale`), moving a
plain one with :meth:`begin_move` / :meth:`finish_move` and making a data-parallel one again on
workers that stay, and :meth:`retire` stops an emptied worker.

Worker loss: a request to a dead worker, or one in flight when it dies, raises
:class:`WorkerLostError` naming the worker and the model, at once (Ray reports the actor's death
to every pending call); the model's later requests raise it too, never hang. ``restore`` puts the
model back from a checkpoint (weights and optimizer state, on storage every worker reads) onto a
live worker, under the same model id (``RoutedScheduler.restore``). A sharded group is lost
whole when any member is (:meth:`TrainerPool.group_lost`: its models name the group and the lost
member), and :meth:`TrainerPool.rebuild_group` starts a new one in its place where the cluster
can place it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from opentinker.cluster.ray_env import LOCAL_SYSTEM_CONFIG, PLACEMENT_TIMEOUT_S
from opentinker.cluster.shard import WorkerLostError
from opentinker.cluster.trainer_worker import TrainerWorker
from opentinker.engine import EngineError
from opentinker.models.registry import canonical_name

STARTUP_TIMEOUT_S = 300.0  # placed workers loading their base-model replicas (as rollout workers)


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
    draining: bool = False  # being removed: no model is placed on it any more
    group: str = ""  # a sharded group's leader: the group's name (its other members are the pool's)
    lost_member: str = ""  # a lost sharded group's leader: the member whose loss broke the group

    @property
    def label(self) -> str:
        """How errors name it: the worker, and its sharded group if it leads one."""
        return f"trainer worker {self.worker_id}" + (f" of sharded group {self.group}" if self.group else "")

    def lost_error(self, model_id: str) -> WorkerLostError:
        """The error every model of this lost worker (or sharded group) answers."""
        if self.group:
            err = WorkerLostError(
                f"sharded group {self.group} lost trainer worker {self.lost_member or self.worker_id}"
                f"{' (its leader)' if self.lost_member in ('', self.worker_id) else ''} with model "
                f"{model_id!r}; restore it from its newest checkpoint"
            )
            err.worker = self.lost_member or self.worker_id
            return err
        return WorkerLostError(
            f"{self.label} was lost ({self.lost_reason}) with model {model_id!r}; "
            "restore it from its newest checkpoint"
        )


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
        ray.init(include_dashboard=False, log_to_driver=False, _system_config=LOCAL_SYSTEM_CONFIG)


def check_resources(workers: int, worker_cpus: float, worker_gpus: float) -> None:
    """Refuse, naming the shortfall, a pool the cluster cannot place (nothing is started)."""
    from opentinker.cluster.ray_env import Ask, ClusterError, check_start

    ray_module()
    if not isinstance(workers, int) or workers < 1:
        raise ClusterConfigError(f"a trainer pool needs at least one worker, got {workers!r}")
    if worker_cpus < 0 or worker_gpus < 0:
        raise ClusterConfigError(f"worker resources must be >= 0, got cpus={worker_cpus}, gpus={worker_gpus}")
    try:
        check_start([Ask(workers, worker_cpus, worker_gpus, "trainer worker", "--trainer")])
    except ClusterError as e:
        raise ClusterConfigError(str(e)) from None


def check_shard_base(base_model: str, workers: int, k: Any) -> int:
    """``k`` as a sharded group's size for ``workers`` trainer workers of ``base_model``, or
    :class:`ClusterConfigError` saying why not (checked before any worker starts)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ClusterConfigError(f"--shard-base must be an integer >= 1, got {k!r}")
    if k > 1 and workers % k:
        raise ClusterConfigError(
            f"--shard-base {k} must divide the trainer workers ({workers}): each sharded group is {k} workers"
        )
    if k > 1:
        from opentinker.cluster.shard import ShardError, check_shard_layout

        try:
            check_shard_layout(base_model, k)
        except ShardError as e:
            raise ClusterConfigError(str(e)) from None
    return k


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
        dtype: str = "float32",
        max_rank: int = 128,
        max_concurrency: int = 256,
        placement_timeout: float = PLACEMENT_TIMEOUT_S,
        startup_timeout: float = STARTUP_TIMEOUT_S,
        shard_base: int = 1,
    ) -> None:
        ray = ray_module()
        check_resources(workers, worker_cpus, worker_gpus)
        self.shard_base = check_shard_base(base_model, workers, shard_base)
        self.members: dict[str, list[WorkerSlot]] = {}  # a sharded group's leader -> every member
        self._groups_made = 0  # sharded groups are named group-0, group-1, ... (never reused)
        self.base_model = canonical_name(base_model)
        self.device = device or ("cuda" if worker_gpus > 0 else "cpu")
        self.worker_cpus, self.worker_gpus = worker_cpus, worker_gpus
        self._cls = ray.remote(TrainerWorker).options(
            num_cpus=worker_cpus, num_gpus=worker_gpus, max_concurrency=max_concurrency, max_restarts=0
        )
        self._actor_kwargs = {
            "device": self.device,
            "dtype": dtype,  # every replica computes what the front-end's engine does
            "max_rank": max_rank,
            "threads": max(1, int(worker_cpus)),
            "shard_base": shard_base,
        }
        self.placement_timeout = placement_timeout
        self.workers = [self._start(r) for r in range(workers)]
        self._next_rank = workers  # ranks are never reused: a worker id names one actor
        self._lock = threading.RLock()
        self._placement: dict[str, WorkerSlot] = {}
        self._dp: dict[str, int] = {}  # data-parallel model -> its degree (reserved on its replicas' slots)
        try:
            self._wait_placed(self.workers)
            infos = ray.get([w.actor.info.remote() for w in self.workers], timeout=startup_timeout)
            if shard_base > 1:
                self._form_groups(startup_timeout)
        except Exception as e:
            self.shutdown()
            if isinstance(e, ray.exceptions.GetTimeoutError):
                raise ClusterConfigError(
                    f"the trainer workers of {self.base_model} did not load within {startup_timeout:g} s"
                ) from None
            raise

        self.limits: dict[str, int] = infos[0]["limits"]  # what a request is checked against

    def _form_groups(self, timeout: float) -> None:
        """Cut the workers into sharded groups of ``shard_base`` (:mod:`opentinker.cluster.shard`):
        each forms its process group and shards its base; only the leaders take models."""
        k = self.shard_base
        groups = [self.workers[g * k : (g + 1) * k] for g in range(len(self.workers) // k)]
        refs = [ref for g, members in enumerate(groups) for ref in self._join(members, f"group-{g}", timeout)]
        self._await_groups(refs, timeout)
        self.workers = [m[0] for m in self.members.values()]
        self._groups_made = len(groups)

    def _join(self, members: list[WorkerSlot], name: str, timeout: float) -> list[Any]:
        """Ask ``members`` to form sharded group ``name`` (member 0 its leader); their refs."""
        ray = ray_module()
        address, port = ray.get(members[0].actor.rendezvous.remote(), timeout=timeout)
        ids = [m.worker_id for m in members]
        refs = []
        for r, m in enumerate(members):
            followers = [o.actor for o in members[1:]] if r == 0 else []
            refs.append(m.actor.shard_join.remote(address, port, r, name, ids, followers))
        members[0].group = name
        self.members[members[0].worker_id] = members
        return refs

    def _await_groups(self, refs: list[Any], timeout: float) -> None:
        ray = ray_module()
        try:
            ray.get(refs, timeout=timeout)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(e.cause, BaseException) else e
            raise ClusterConfigError(
                f"the sharded groups of {self.base_model} did not form: {cause}"
            ) from None

    def _wait_placed(self, slots: list[WorkerSlot]) -> None:
        """Every slot's actor placed within the placement timeout, or :class:`ClusterConfigError`
        naming the ones that were not (a pool that waits for resources never given would hang)."""
        from opentinker.cluster.ray_env import Ask, ClusterError, wait_placed

        each = Ask(1, self.worker_cpus, self.worker_gpus, "trainer worker", "--trainer")
        named = {f"trainer worker {s.worker_id} of {self.base_model}": s.actor for s in slots}
        try:
            wait_placed(named, each, self.placement_timeout)
        except ClusterError as e:
            raise ClusterConfigError(str(e)) from None

    def _start(self, rank: int) -> WorkerSlot:
        wid = f"trainer-{rank}"
        return WorkerSlot(rank, wid, self._cls.remote(self.base_model, worker_id=wid, **self._actor_kwargs))

    # ------------------------------------------------------------------ elastic
    def add_workers(self, n: int, *, timeout: float = 300.0) -> list[WorkerSlot]:
        """Start ``n`` more workers (the same resources as the others) and, once every one has
        loaded its replica, place models on them. The free resources are checked first; a
        worker that fails to start fails the call (``RuntimeError`` naming it) and every one
        started by it is stopped, the pool unchanged."""
        from opentinker.cluster.ray_env import ClusterError, check_fits

        ray = ray_module()
        if self.shard_base > 1:
            raise ClusterConfigError("a pool of sharded groups (--shard-base) is not scaled while serving")
        try:
            check_fits(n, self.worker_cpus, self.worker_gpus, what="trainer worker")
        except ClusterError as e:
            raise ClusterConfigError(str(e)) from None
        with self._lock:
            ranks = list(range(self._next_rank, self._next_rank + n))
            self._next_rank += n
        slots = [self._start(r) for r in ranks]
        try:
            self._wait_placed(slots)
            ray.get([s.actor.info.remote() for s in slots], timeout=timeout)
        except Exception as e:
            for slot in slots:
                ray.kill(slot.actor, no_restart=True)
            if isinstance(e, ClusterConfigError):
                raise
            reason = (
                "did not start in time" if isinstance(e, ray.exceptions.GetTimeoutError) else type(e).__name__
            )
            raise RuntimeError(
                f"new trainer workers {', '.join(s.worker_id for s in slots)} failed to start: {reason}"
            ) from None
        with self._lock:
            self.workers.extend(slots)
        return slots

    def choose_leaving(self, n: int) -> dict[str, list[str]]:
        """Mark the ``n`` workers to remove as draining (no new model goes to them) and return
        each one's models (worker id -> model ids).

        Workers holding no data-parallel replica come first, the least loaded (ties: the newest).
        Where fewer than ``n`` of them are live, every one of them leaves and the rest are taken,
        in the same order, among the workers holding replicas whose data-parallel models can each
        be made again at their degree on the live workers that stay. Refused, nothing changed,
        naming the models and why, if no such choice exists, or if fewer than one live worker
        would be left."""
        if self.shard_base > 1:
            raise ClusterConfigError("a pool of sharded groups (--shard-base) is not scaled while serving")
        with self._lock:
            live = self.open_workers()
            if len(live) - n < 1:
                raise ClusterConfigError(
                    f"trainer workers cannot be scaled below one (asked to remove {n} of {len(live)})"
                )
            order = sorted(live, key=lambda w: (len(w.models), w.in_flight, -w.rank))
            free = [w for w in order if not w.models & self._dp.keys()]
            leaving = free[:n]
            if len(leaving) < n:
                leaving += self._replica_holders_leaving(n - len(leaving), order, leaving)
            for w in leaving:
                w.draining = True
            return {w.worker_id: sorted(w.models) for w in leaving}

    def _replica_holders_leaving(
        self, k: int, order: list[WorkerSlot], leaving: list[WorkerSlot]
    ) -> list[WorkerSlot]:
        """``k`` workers holding data-parallel replicas that may leave besides ``leaving`` (the
        workers holding none, all of them), in ``order``: each of their data-parallel models
        needs its degree in live workers that stay. How many stay does not depend on which are
        chosen; only the models do."""
        held = [w for w in order if w.models & self._dp.keys()]
        stay = sum(1 for w in self.open_workers() if w not in leaving) - k
        why: dict[str, str] = {}
        able: list[WorkerSlot] = []
        for w in held:
            blocked = [m for m in sorted(w.models & self._dp.keys()) if self._dp[m] > stay]
            for m in blocked:
                why[m] = f"degree {self._dp[m]} needs {self._dp[m]} trainer workers, {stay} would be left"
            if not blocked:
                able.append(w)
        if len(able) < k:
            names = "; ".join(f"data-parallel model {m!r}: {r}" for m, r in sorted(why.items()))
            raise ClusterConfigError(
                f"cannot remove {k + len(leaving)} trainer worker(s): {len(leaving)} hold no data-parallel "
                f"replica and the others' models cannot be handed over at their degree ({names})"
            )
        return able[:k]

    def slot(self, worker_id: str) -> WorkerSlot:
        with self._lock:
            for w in self.workers:
                if w.worker_id == worker_id:
                    return w
        raise EngineError(f"no trainer worker {worker_id!r}")

    def begin_move(self, model_id: str) -> WorkerSlot:
        """The worker ``model_id`` moves to: the least loaded live one not draining, counted as
        holding it from now (routing still goes to its old worker until :meth:`finish_move`)."""
        with self._lock:
            target = self.least_loaded()
            target.models.add(model_id)
            return target

    def finish_move(self, model_id: str, target: WorkerSlot) -> None:
        """Route ``model_id`` to ``target`` from now on."""
        with self._lock:
            old = self._placement.get(model_id)
            if old is not None and old is not target:
                old.models.discard(model_id)
            self._placement[model_id] = target

    def abort_move(self, model_id: str, target: WorkerSlot) -> None:
        with self._lock:
            if self._placement.get(model_id) is not target:
                target.models.discard(model_id)

    def undrain(self, slot: WorkerSlot) -> None:
        with self._lock:
            slot.draining = False

    def retire(self, slot: WorkerSlot) -> None:
        """Stop an emptied worker's actor and drop it from the pool."""
        with self._lock:
            if slot.models:
                raise EngineError(f"trainer worker {slot.worker_id} still holds {sorted(slot.models)}")
            slot.alive, slot.lost_reason = False, "removed"
            self.workers = [w for w in self.workers if w is not slot]
        ray_module().kill(slot.actor, no_restart=True)

    def open_workers(self) -> list[WorkerSlot]:
        """The workers a new model (data-parallel replicas included) may be placed on: the live
        ones not draining."""
        with self._lock:
            return [w for w in self.workers if w.alive and not w.draining]

    # ------------------------------------------------------------------ placement
    def reserve(self, model_id: str, slots: list[WorkerSlot]) -> None:
        """Count ``model_id`` (a data-parallel model, routed by itself) on each of ``slots``."""
        with self._lock:
            if model_id in self._placement or any(model_id in w.models for w in self.workers):
                raise EngineError(f"model {model_id!r} already exists")
            for w in slots:
                w.models.add(model_id)
            self._dp[model_id] = len(slots)

    def release(self, model_id: str, slots: list[WorkerSlot]) -> None:
        with self._lock:
            for w in slots:
                w.models.discard(model_id)
            self._dp.pop(model_id, None)

    def worker_of(self, model_id: str) -> WorkerSlot:
        """The live worker holding ``model_id``; a lost one raises :class:`WorkerLostError`."""
        with self._lock:
            slot = self._placement.get(model_id)
        if slot is None:
            raise EngineError(f"unknown model {model_id!r}")
        if not slot.alive:
            raise slot.lost_error(model_id)
        return slot

    def live_workers(self) -> list[WorkerSlot]:
        with self._lock:
            return [w for w in self.workers if w.alive]

    def least_loaded(self, exclude: set[int] | None = None) -> WorkerSlot:
        with self._lock:
            live = [w for w in self.open_workers() if w.rank not in (exclude or set())]
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
            self.note_group_loss(slot, cause)
            raise cause from None
        except ray.exceptions.RayActorError as e:
            self.mark_lost(slot, type(e).__name__)
            if slot.group:
                self.group_lost(slot, slot.worker_id)
                raise slot.lost_error(model_id) from None
            raise WorkerLostError(
                f"{slot.label} was lost while serving model {model_id!r}; "
                "restore it from its newest checkpoint"
            ) from None

    def mark_lost(self, slot: WorkerSlot, reason: str) -> None:
        with self._lock:
            slot.alive = False
            slot.lost_reason = reason or slot.lost_reason

    # ------------------------------------------------------------------ a sharded group's loss
    def note_group_loss(self, slot: WorkerSlot, error: BaseException) -> None:
        """``error`` came from ``slot``: where it is the leader of a sharded group reporting a
        lost member, the whole group is lost (:meth:`group_lost`)."""
        if slot.group and isinstance(error, WorkerLostError) and error.worker:
            self.group_lost(slot, error.worker)

    def group_lost(self, leader: WorkerSlot, member: str) -> None:
        """Sharded group ``leader.group`` lost its member ``member``: its process group and its
        base are broken, so the whole group is: every model of it answers
        :class:`WorkerLostError` naming the group and ``member``, and the members still alive
        are stopped (what they hold is the group's, and their resources go back to the cluster
        for :meth:`rebuild_group`)."""
        with self._lock:
            members = self.members.get(leader.worker_id, [leader])
            if leader.lost_member:
                return
            leader.lost_member = member
            leader.lost_reason = f"sharded group {leader.group} lost trainer worker {member}"
            alive = [m for m in members if m.alive]
            for m in members:
                m.alive = False
        ray = ray_module()

        def stop() -> None:  # apart: a loss seen in a Ray callback must not wait on Ray from it
            for m in alive:
                ray.kill(m.actor, no_restart=True)

        threading.Thread(target=stop, name="opentinker-group-lost", daemon=True).start()

    def rebuild_group(self, lost: WorkerSlot, timeout: float = STARTUP_TIMEOUT_S) -> WorkerSlot:
        """A new sharded group of ``shard_base`` fresh workers in place of lost group
        ``lost.group``: its leader (which takes models from now on). Where the cluster cannot
        place them, :class:`ClusterConfigError` saying how many workers the group needs and what
        the cluster has free (it waits a few seconds for the lost group's resources to come back)."""
        from opentinker.cluster.ray_env import FREED_GRACE_S, Ask, fit_error, resources

        k, ray = self.shard_base, ray_module()
        ask = [Ask(k, self.worker_cpus, self.worker_gpus, "trainer worker", "--trainer")]
        deadline = time.monotonic() + FREED_GRACE_S
        while (why := fit_error(ask, resources(), more=True)) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        if why is not None:
            raise ClusterConfigError(
                f"sharded group {lost.group} cannot be rebuilt: it needs {k} trainer workers "
                f"(--shard-base {k}): {why}"
            )
        with self._lock:
            ranks = list(range(self._next_rank, self._next_rank + k))
            self._next_rank += k
            name = f"group-{self._groups_made}"
            self._groups_made += 1
        slots = [self._start(r) for r in ranks]
        try:
            self._wait_placed(slots)
            ray.get([s.actor.info.remote() for s in slots], timeout=timeout)
            self._await_groups(self._join(slots, name, timeout), timeout)
        except Exception as e:
            for s in slots:
                ray.kill(s.actor, no_restart=True)
            self.members.pop(slots[0].worker_id, None)
            if isinstance(e, ClusterConfigError):
                raise
            raise ClusterConfigError(
                f"sharded group {name} (rebuilding {lost.group}) failed to start: {e}"
            ) from None
        with self._lock:
            self.workers.append(slots[0])
        return slots[0]

    def kill_worker(self, rank: int) -> None:
        """Kill one worker's actor at once (what a crashed node does; the tests' fault)."""
        [slot] = [w for w in self.all_workers() if w.rank == rank]
        ray_module().kill(slot.actor, no_restart=True)

    def all_workers(self) -> list[WorkerSlot]:
        """Every worker, a sharded group's members included."""
        with self._lock:
            members = [m for g in self.members.values() for m in g[1:]]
            return [*self.workers, *members]

    def shutdown(self) -> None:
        """Kill every worker's actor (nothing to do once Ray itself is shut down)."""
        import ray

        if not ray.is_initialized():
            return
        for w in self.all_workers():
            if w.alive:
                ray.kill(w.actor, no_restart=True)
                w.alive = False
