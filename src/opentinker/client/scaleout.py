"""Where a runtime's work runs beyond its own process: rollout worker pools (processes, or Ray
actors), and trainer workers on Ray with the auto-restore of a lost worker's models.

:class:`ScaleOut` checks a runtime's scale-out settings once, at construction, so a Ray address
that does not answer or workers the cluster cannot place fail there, naming why, before any model
loads. Nothing of :mod:`opentinker.cluster` (nor Ray) is imported unless Ray is asked for.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentinker.engine import Engine
from opentinker.lora import LoRAConfig
from opentinker.rollout.pool import WorkerPool
from opentinker.sampling import RolloutBackend
from opentinker.sampling.rollout import RolloutService
from opentinker.scheduler import Scheduler

if TYPE_CHECKING:
    from opentinker.client.checkpoints import CheckpointStore

_log = logging.getLogger(__name__)


class ScaleOut:
    def __init__(
        self,
        *,
        rollout_workers: int,
        ray: str | None,
        worker_cpus: float,
        worker_gpus: float,
        worker_startup_timeout: float,
        trainer_workers: int,
        trainer_options: dict[str, Any] | None,
        auto_restore: bool,
    ) -> None:
        if not isinstance(trainer_workers, int) or trainer_workers < 0:
            raise ValueError(f"trainer_workers must be an integer >= 0, got {trainer_workers!r}")
        self.trainer_workers = trainer_workers
        self.trainer_options = dict(trainer_options or {})
        # every new model's data-parallel degree unless it asks for its own; checked before Ray starts
        self.data_parallel = self.data_parallel_degree(self.trainer_options.pop("data_parallel", 1))
        self.ray_cluster: Any = None  # opentinker.cluster.ray_env.Cluster, with ray=...
        self.worker_cpus, self.worker_gpus = worker_cpus, worker_gpus
        self.worker_startup_timeout = worker_startup_timeout
        self.ray_rollout = ray is not None and bool(rollout_workers)  # rollout workers as actors
        if ray is not None:
            if not rollout_workers and not trainer_workers:
                raise ValueError(
                    "ray runs rollout or trainer workers as actors: give rollout_workers >= 1 "
                    "or trainer_workers >= 1"
                )
            from opentinker.cluster.ray_env import check_fits, connect
            from opentinker.cluster.ray_rollout import RayTransport

            RayTransport(worker_cpus, worker_gpus)  # refuses resources no worker could have
            self.ray_cluster = connect(ray)
            if rollout_workers:
                check_fits(rollout_workers, worker_cpus, worker_gpus)
        self.auto_restore = auto_restore
        self.restored: dict[str, dict[str, Any]] = {}  # model -> how auto-restore brought it back
        self._scale_lock = threading.Lock()  # one trainer scale at a time
        if trainer_workers:
            from opentinker.cluster.trainer import check_resources, start_local_ray

            if self.ray_cluster is None:  # no address given: a Ray instance started here
                start_local_ray()
            check_resources(
                trainer_workers,
                float(self.trainer_options.get("worker_cpus", 1.0)),
                float(self.trainer_options.get("worker_gpus", 0.0)),
            )

    def data_parallel_degree(self, value: Any) -> int:
        """The data-parallel degree ``value`` asks for (an integer, or its text as ``user_metadata``
        carries it), checked against the trainer workers; ``ValueError`` naming the problem."""
        text = value.strip() if isinstance(value, str) else value
        if isinstance(text, bool) or not (
            isinstance(text, int) or (isinstance(text, str) and text.isascii() and text.isdigit())
        ):
            raise ValueError(f"data_parallel must be an integer >= 1, got {value!r}")
        degree = int(text)
        if degree < 1:
            raise ValueError(f"data_parallel must be an integer >= 1, got {value!r}")
        if degree > max(1, self.trainer_workers):
            raise ValueError(
                f"data_parallel {degree} is above the number of trainer workers ({self.trainer_workers})"
                + ("" if self.trainer_workers else "; serve with --ray --trainer-workers N")
            )
        return degree

    def create_adapter(self, eng: Engine, config: LoRAConfig, model_id: str, degree: int) -> None:
        """Model ``model_id``'s adapter: on one worker (or this process), or data-parallel over
        ``degree`` trainer workers (``eng`` is then the router's proxy, :mod:`opentinker.cluster.dp`)."""
        if degree == 1:
            eng.create_adapter(config, model_id)
        else:
            eng.create_data_parallel(config, model_id, degree)  # type: ignore[attr-defined]

    def transport(self) -> Any:
        """How a base model's rollout workers are reached: processes here (None), or Ray actors."""
        if not self.ray_rollout:
            return None
        from opentinker.cluster.ray_rollout import RayTransport

        return RayTransport(self.worker_cpus, self.worker_gpus)

    def workers_info(
        self, pools: Mapping[str, WorkerPool], rollout_workers: int, routers: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The rollout workers now: per base model, each worker's state and requests served; and
        with trainer workers, per base model each trainer worker and the models it holds."""
        out: dict[str, Any] = {}
        for name, pool in pools.items():
            stats = pool.stats
            out[name] = {
                "workers": pool.size,
                "transport": pool.transport.name,
                "states": pool.worker_states(),
                "served": stats.served,
                "restarts": stats.restarts,
                "rerun": stats.rerun,
            }
        info: dict[str, Any] = {
            "ray": None if self.ray_cluster is None else self.ray_cluster.address,
            "rollout_workers": rollout_workers,
            "base_models": out,
        }
        if self.trainer_workers:
            info["trainer_workers"] = self.trainer_workers
            info["trainers"] = {name: r.trainer_info() for name, r in (routers or {}).items()}
        return info

    def check_trainer_scale(self, routers: Mapping[str, Any], workers: Any) -> None:
        """Refuse (``ValueError``, nothing changed) a trainer scale below one worker, without
        trainer workers, or needing more than the Ray cluster has free."""
        from opentinker.cluster.ray_env import check_fits
        from opentinker.cluster.trainer_scale import check_scale

        check_scale(workers)
        if not self.trainer_workers:
            raise ValueError(
                "this service trains in its own process: no trainer workers to scale "
                "(serve it with --trainer-workers N)"
            )
        extra = sum(
            max(0, workers - sum(1 for w in r.pool.live_workers() if not w.draining))
            for r in routers.values()
        )
        if extra:
            opts = self.trainer_options
            cpus, gpus = float(opts.get("worker_cpus", 1.0)), float(opts.get("worker_gpus", 0.0))
            check_fits(extra, cpus, gpus, what="trainer worker")

    def scale_trainers(self, routers: Mapping[str, Any], workers: int, folder: Path) -> dict[str, Any]:
        """Serve every base model's training from ``workers`` trainer workers, while serving (see
        :mod:`opentinker.cluster.trainer_scale`); per base model what was added, removed, moved."""
        from opentinker.cluster.trainer_scale import scale_trainers

        with self._scale_lock:
            self.check_trainer_scale(routers, workers)
            out = {name: scale_trainers(r, workers, folder / _safe(name)) for name, r in routers.items()}
            self.trainer_workers = workers  # base models loaded later start this many
        return out

    @staticmethod
    def scale(pools: Mapping[str, WorkerPool], workers: int) -> dict[str, int]:
        """Serve every base model's sampling from ``workers`` rollout workers, while serving (see
        :meth:`Runtime.scale_rollout_workers <opentinker.client.runtime.Runtime.scale_rollout_workers>`)."""
        ScaleOut.check_rollout_scale(pools, workers)
        return {name: pool.scale(workers) for name, pool in pools.items()}

    @staticmethod
    def check_rollout_scale(pools: Mapping[str, WorkerPool], workers: Any) -> None:
        """Refuse (``ValueError``, nothing changed) what :meth:`scale` cannot do."""
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"rollout workers cannot be scaled below one, got {workers!r}")
        if not pools:
            raise ValueError(
                "this service has no rollout workers to scale (serve it with --rollout-workers N)"
            )
        extra = sum(max(0, workers - p.size) for p in pools.values())
        if extra:
            next(iter(pools.values())).transport.check_capacity(extra)

    def scheduler(
        self,
        name: str,
        engine: Engine,
        sampler: RolloutBackend,
        rollout: RolloutService | None,
        *,
        device: str,
        max_rank: int,
        models: Callable[[], Mapping[str, Any]],
        store: CheckpointStore,
    ) -> Scheduler:
        """The base model's scheduler: training here, or routed to its trainer workers (a lost
        worker's models are then put back by :meth:`worker_lost`)."""
        if not self.trainer_workers:
            return Scheduler(engine, sampler, rollout=rollout)
        from opentinker.cluster.trainer import TrainerPool
        from opentinker.cluster.trainer_router import RoutedScheduler

        opts = self.trainer_options
        pool = TrainerPool(
            name,
            self.trainer_workers,
            worker_cpus=float(opts.get("worker_cpus", 1.0)),
            worker_gpus=float(opts.get("worker_gpus", 0.0)),
            device=device,
            max_rank=max_rank,
        )
        router = RoutedScheduler(engine, sampler, pool, rollout=rollout)
        router.on_worker_lost = lambda slot, lost: self.worker_lost(
            router, slot.worker_id, lost, models(), store
        )
        return router

    def worker_lost(
        self, router: Any, worker_id: str, lost: list[str], models: Mapping[str, Any], store: CheckpointStore
    ) -> None:
        """A trainer worker is gone: with ``auto_restore``, each of its models is put back from
        its newest ``save_state`` checkpoint; :attr:`restored` records how (or why not)."""
        for model_id in lost:
            rec = models.get(model_id)
            if rec is None or rec.deleted:
                continue
            lost_at = int(router.steps.get(model_id, 0))
            entry: dict[str, Any] = {"worker": worker_id, "steps_at_loss": lost_at, "restored": False}
            saved = [
                r for r in store.list(model_id) if r.ref.kind == "weights" and r.meta.get("has_optimizer")
            ]
            if not self.auto_restore or not saved:
                entry["reason"] = (
                    "auto-restore is off" if not self.auto_restore else "no save_state checkpoint"
                )
                self.restored[model_id] = entry
                continue
            newest = saved[-1]
            step = int(newest.meta.get("step", 0))
            try:
                entry["to_worker"] = router.restore(model_id, str(newest.folder)).result()
            except Exception as e:  # reported, not raised: this runs on a background thread
                entry["reason"] = str(e)
                self.restored[model_id] = entry
                continue
            rec.parent = newest.ref.tinker_path
            entry.update(restored=True, checkpoint=newest.ref.tinker_path, lost_steps=max(0, lost_at - step))
            self.restored[model_id] = entry
            _log.warning(
                "trainer worker %s lost: model %s restored from %s on %s; %d step(s) lost",
                worker_id, model_id, newest.ref.tinker_path, entry["to_worker"], entry["lost_steps"],
            )  # fmt: skip


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
