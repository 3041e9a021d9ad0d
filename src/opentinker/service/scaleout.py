"""Where a runtime's work runs beyond its own process: rollout worker pools (processes, or Ray
actors), and trainer workers on Ray with the auto-restore of a lost worker's models.

:class:`ScaleOut` checks a runtime's scale-out settings once, at construction, so a Ray address
that does not answer or workers the cluster cannot place fail there, naming why, before any model
loads. Nothing of :mod:`opentinker.cluster` (nor Ray) is imported unless Ray is asked for.
:class:`ScaleOut` is also the scale-out half of :class:`~opentinker.service.runtime.Runtime`
(``runtime.scaleout``): the workers now, scaling them while it serves, data-parallel degrees,
what auto-restore did. It reads the settings from the runtime's
:class:`~opentinker.service.config.RuntimeConfig` under the same names.

Data-parallel models and checkpoints: a checkpoint of a data-parallel model records its degree
(``data_parallel`` in its manifest's metadata); a model made from it (and one auto-restored after
a worker's loss) keeps that degree where the trainer workers can hold it, else it is made on one
worker and its record's ``note`` (also logged, and in the response) says why
(:meth:`ScaleOut.checkpoint_degree`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentinker.engine import DataParallelTrainer, Engine, EngineError, Trainer
from opentinker.lora import LoRAConfig
from opentinker.models.registry import canonical_name
from opentinker.sampling.handles import SamplingService
from opentinker.scheduler import Scheduler
from opentinker.workers.pool import WorkerPool
from opentinker.workers.wire import WorkerOptions

if TYPE_CHECKING:
    from opentinker.cluster.trainer_router import RoutedScheduler
    from opentinker.service.checkpoints import CheckpointStore
    from opentinker.service.config import RuntimeConfig

_log = logging.getLogger(__name__)


class ScaleOut:
    """A runtime's scale-out settings (its :class:`RuntimeConfig`), checked once, and what runs on them.

    ``rollout_workers``: serve sampling from that many worker processes per base model
    (:mod:`opentinker.workers.pool`; 0: the runtime's own sampling loop). ``ray``: run them as Ray
    actors of ``worker_cpus`` CPUs and ``worker_gpus`` GPUs each (:mod:`opentinker.cluster.ray_rollout`),
    on a Ray instance started here (``"local"``) or a cluster joined (``"auto"``,
    ``"ray://HOST:PORT"``, ``"HOST:PORT"``); an address that does not answer, or workers the
    cluster cannot place (rollout and trainer workers counted together), raise ``ValueError``
    here. A worker Ray has not placed within ``placement_timeout`` seconds, or not started within
    ``worker_startup_timeout`` seconds, fails its pool's start, naming why. ``trainer_workers``:
    train on that many Ray trainer workers per base model (:mod:`opentinker.cluster.trainer_router`;
    on the Ray of ``ray``, else a local instance started if none is up), each a base-model
    replica holding a shard of the adapters; ``trainer_cpus`` and ``trainer_gpus`` size each, and
    a size the cluster cannot place is refused here; ``data_parallel`` K makes every new model data-parallel over K of them
    (:mod:`opentinker.cluster.dp`). ``auto_restore``: when a trainer worker is lost, put each of
    its models back from its newest ``save_state`` checkpoint on another worker (:attr:`restored`
    says from where, how many steps were lost, and the degree it came back at).
    """

    def __init__(
        self,
        config: RuntimeConfig,
        *,
        dtype: str,
        data_dir: Path,
        checkpoints: Callable[[], CheckpointStore],
        models: dict[str, Any],
        stacks: Callable[[], dict[str, Any]],
    ) -> None:
        """``dtype``: the base models' dtype by name (it travels to workers as is);
        ``checkpoints()``: the runtime's checkpoint store (made after this checks); ``models``:
        the runtime's model records (auto-restore updates them); ``stacks()``: its loaded base
        models' base stacks (engine, sampler, scheduler), read under its lock."""
        self.config, self.dtype, self.data_dir, self._checkpoints = config, dtype, data_dir, checkpoints
        self.models, self._stacks = models, stacks
        rollout_workers, trainer_workers = config.rollout_workers, config.trainer_workers
        ray, placement_timeout = config.ray, config.placement_timeout
        worker_cpus, worker_gpus = config.worker_cpus, config.worker_gpus
        if not isinstance(rollout_workers, int) or rollout_workers < 0:
            raise ValueError(f"rollout_workers must be an integer >= 0, got {rollout_workers!r}")
        if not isinstance(trainer_workers, int) or trainer_workers < 0:
            raise ValueError(f"trainer_workers must be an integer >= 0, got {trainer_workers!r}")
        self.rollout_workers = rollout_workers  # now: scaled while serving
        self.trainer_workers = trainer_workers
        # every new model's data-parallel degree unless it asks for its own; checked before Ray starts
        self.shard_base = 1
        self.data_parallel = self.data_parallel_degree(config.data_parallel)
        self.shard_base = self._shard_base(config.shard_base)
        self.sample_on_group = self._sample_on_group(config)
        self.ray_cluster: Any = None  # opentinker.cluster.ray_env.Cluster, with ray=...
        self.worker_startup_timeout = config.worker_startup_timeout
        if not placement_timeout > 0:
            raise ValueError(f"placement_timeout must be > 0 seconds, got {placement_timeout!r}")
        self.placement_timeout = placement_timeout
        self.ray_rollout = ray is not None and bool(rollout_workers)  # rollout workers as actors
        if ray is not None:
            if not rollout_workers and not trainer_workers:
                raise ValueError(
                    "ray runs rollout or trainer workers as actors: give rollout_workers >= 1 "
                    "or trainer_workers >= 1"
                )
            from opentinker.cluster.ray_env import connect
            from opentinker.cluster.ray_rollout import RayTransport

            RayTransport(worker_cpus, worker_gpus)  # refuses resources no worker could have
            self.ray_cluster = connect(ray)
        self.auto_restore = config.auto_restore
        self.restored: dict[str, dict[str, Any]] = {}  # model -> how auto-restore brought it back
        self._scale_lock = threading.Lock()  # one trainer scale at a time
        if trainer_workers:
            from opentinker.cluster.trainer import start_local_ray

            cpus, gpus = self._trainer_size()
            if not cpus >= 0 or not gpus >= 0:
                raise ValueError(f"trainer worker resources must be >= 0, got cpus={cpus}, gpus={gpus}")
            if self.ray_cluster is None:  # no address given: a Ray instance started here
                start_local_ray()
        if self.ray_rollout or trainer_workers:
            self._check_fits()

    def start_asks(self, base_models: int = 1) -> list[Any]:
        """What starting ``base_models`` base models asks of Ray: each base model's rollout workers
        (when they are Ray actors) and trainer workers (:class:`~opentinker.cluster.ray_env.Ask`).
        A data-parallel model asks nothing more: its replicas live on these trainer workers."""
        from opentinker.cluster.ray_env import Ask

        asks = []
        if self.ray_rollout:
            n = self.rollout_workers * base_models
            asks.append(
                Ask(n, self.config.worker_cpus, self.config.worker_gpus, "rollout worker", "--worker")
            )
        if self.trainer_workers:
            n = self.trainer_workers * base_models
            asks.append(Ask(n, *self._trainer_size(), "trainer worker", "--trainer"))
        return asks

    def _check_fits(self, base_models: int = 1) -> None:
        """Refuse (``ValueError`` naming the CPUs and GPUs asked for per kind and what the cluster
        has) a start of ``base_models`` base models whose workers, every kind together, the Ray
        cluster cannot place: before any of them is placed, so that a start never waits for
        resources that are not there (:func:`~opentinker.cluster.ray_env.check_start`)."""
        if base_models < 1 or not (self.ray_rollout or self.trainer_workers):
            return
        from opentinker.cluster.ray_env import check_start

        check_start(self.start_asks(base_models))

    def check_start(self, base_models: list[str]) -> None:
        """``ValueError`` unless the Ray cluster can place the workers of every base model of
        ``base_models`` not loaded yet, all kinds together."""
        new = {canonical_name(b) for b in base_models} - set(self._stacks())
        self._check_fits(len(new))

    def check_data_parallel(self, value: int | str | None) -> int:
        """The data-parallel degree ``value`` asks for (None: the default), or ``ValueError``."""
        return self.data_parallel if value is None else self.data_parallel_degree(value)

    def _shard_base(self, value: Any) -> int:
        """The size of the sharded groups (``shard_base``, ``--shard-base``),
        checked before Ray starts (its fit to the model's layers: when the pool starts)."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"shard_base must be an integer >= 1, got {value!r}")
        if value > 1 and not self.trainer_workers:
            raise ValueError(
                "shard_base shards the base over trainer workers: serve with --ray --trainer-workers N"
            )
        if value > 1 and self.trainer_workers % value:
            raise ValueError(
                f"shard_base {value} must divide the trainer workers ({self.trainer_workers}): "
                f"each sharded group is {value} workers"
            )
        if value > 1 and self.data_parallel > 1:
            raise ValueError(
                "data parallelism over sharded groups is not served: give shard_base or data_parallel"
            )
        return value

    def _sample_on_group(self, config: RuntimeConfig) -> bool:
        """Whether a sharded base samples on its group (``shard_sampling``:
        :mod:`opentinker.cluster.shard_sampling`), refusing settings that sample on whole copies."""
        where = config.shard_sampling
        if where not in ("group", "front"):
            raise ValueError(f"shard_sampling must be 'group' or 'front', got {where!r}")
        if self.shard_base == 1 or where == "front":
            return False
        other = (
            "rollout_workers"
            if config.rollout_workers
            else "rollout_backend='vllm'"
            if config.rollout_backend == "vllm"
            else None
        )
        if other is not None:
            where = (
                "vLLM's own copy of the base (tensor-parallel with rollout_tensor_parallel; the "
                "front-end then holds none)"
                if other.startswith("rollout_backend")
                else "whole copies of the base"
            )
            raise ValueError(
                f"a sharded base samples on its group (shard_sampling='group', the default with "
                f"shard_base), but {other} samples on {where}: give shard_sampling='front' "
                "(--shard-sampling front) for that"
            )
        return True

    def front_base(self, name: str) -> Any:
        """The front-end's base model of ``name`` when its group samples, or vLLM does (its config
        and tokenizer, the model on the meta device: the front-end loads no copy of a sharded
        base), else None (the runtime loads it whole)."""
        vllm_samples = self.shard_base > 1 and self.config.rollout_backend == "vllm"
        if not (self.sample_on_group or vllm_samples):
            return None
        from opentinker.cluster.shard_sampling import front_base

        return front_base(name, self.dtype)

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
        if degree > 1 and self.shard_base > 1:
            raise ValueError("data parallelism over sharded groups (shard_base) is not served")
        return degree

    def create_adapter(self, eng: Trainer, config: LoRAConfig, model_id: str, degree: int) -> None:
        """Model ``model_id``'s adapter: on one worker (or this process), or data-parallel over
        ``degree`` trainer workers (:mod:`opentinker.cluster.dp`)."""
        if degree == 1:
            eng.create_adapter(config, model_id)
        else:
            data_parallel_of(eng).create_data_parallel(config, model_id, degree)

    def rollout_pool(self, engine: Engine, name: str) -> WorkerPool:
        """``name``'s sampling served by :attr:`rollout_workers` rollout worker processes or actors,
        each with its own copy of the base model; snapshots go to them as bytes."""
        from opentinker.sampling import NativeBackend

        pin = NativeBackend(engine, lean_decode=False, prefix_cache_bytes=0).decoder(snapshots_only=True).pin
        return WorkerPool(
            engine,
            pin,
            self.rollout_workers,
            WorkerOptions(
                base_model=name,
                backend=self.config.rollout_backend,
                device=self.config.device,
                dtype=self.dtype,
                max_rank=self.config.max_rank,
                prefix_cache_bytes=self.config.prefix_cache_bytes,
            ),
            startup_timeout=self.worker_startup_timeout,
            transport=self.transport(),
        )

    def shutdown(self) -> None:
        """Stop the Ray instance this runtime started, if any."""
        if self.ray_cluster is not None:
            from opentinker.cluster.ray_env import shutdown

            shutdown(self.ray_cluster)
            self.ray_cluster = None

    def transport(self) -> Any:
        """How a base model's rollout workers are reached: processes here (None), or Ray actors."""
        if not self.ray_rollout:
            return None
        from opentinker.cluster.ray_rollout import RayTransport

        return RayTransport(self.config.worker_cpus, self.config.worker_gpus, self.placement_timeout)

    def _worker_pools(self) -> dict[str, WorkerPool]:
        return {
            n: b.scheduler.rollout
            for n, b in self._stacks().items()
            if isinstance(b.scheduler.rollout, WorkerPool)
        }

    def _routers(self) -> dict[str, RoutedScheduler]:
        """Per base model, the router of its trainer workers (none: models train in this process)."""
        if not self.trainer_workers:
            return {}
        from opentinker.cluster.trainer_router import RoutedScheduler

        return {n: b.scheduler for n, b in self._stacks().items() if isinstance(b.scheduler, RoutedScheduler)}

    def rollout_workers_info(self) -> dict[str, Any]:
        """The workers now: per base model, each rollout worker's state and requests served; and
        with trainer workers, per base model each trainer worker and the models it holds."""
        out: dict[str, Any] = {}
        for name, pool in self._worker_pools().items():
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
            "rollout_workers": self.rollout_workers,
            "base_models": out,
        }
        if self.trainer_workers:
            info["trainer_workers"] = self.trainer_workers
            info["trainers"] = {name: r.trainer_info() for name, r in self._routers().items()}
        return info

    def worker_counts(self) -> dict[str, dict[str, Any]]:
        """Per base model with workers, its rollout workers by state (and transport), their
        restarts and re-run requests, and its trainer workers alive and lost: read here, no call
        to any worker (``/metrics``)."""
        out: dict[str, dict[str, Any]] = {}
        for name, pool in self._worker_pools().items():
            stats = pool.stats
            out.setdefault(name, {})["rollout"] = {
                "transport": pool.transport.name,
                "states": pool.worker_states(),
                "restarts": sum(stats.restarts),
                "rerun": stats.rerun,
            }
        for name, router in self._routers().items():
            workers = list(router.pool.workers)
            alive = sum(1 for w in workers if w.alive)
            lost = sum(1 for w in workers if not w.alive and w.lost_reason != "removed")  # not scaled away
            out.setdefault(name, {})["trainers"] = {"alive": alive, "lost": lost}
        return out

    def check_scale(self, rollout_workers: Any = None, trainer_workers: Any = None) -> None:
        """Refuse (``ValueError``, nothing changed) a scale of the rollout and/or trainer workers
        (each one given) that cannot be done: each kind on its own (below one worker, none to
        scale, more than the cluster has free), then both together: the new workers of both
        kinds must fit in what the Ray cluster has free now (workers a scale removes are not
        counted as freed: the two scales run one after the other)."""
        pools, routers = self._worker_pools(), self._routers()
        rollout = 0 if rollout_workers is None else self.check_rollout_scale(pools, rollout_workers)
        trainer = 0 if trainer_workers is None else self.check_trainer_scale(routers, trainer_workers)
        if self.ray_rollout and rollout and trainer:  # rollout processes here are not Ray's to place
            from opentinker.cluster.ray_env import Ask, check_fits_together

            check_fits_together(
                [
                    Ask(rollout, self.config.worker_cpus, self.config.worker_gpus, "rollout worker"),
                    Ask(trainer, *self._trainer_size(), "trainer worker"),
                ]
            )

    def _trainer_size(self) -> tuple[float, float]:
        return float(self.config.trainer_cpus), float(self.config.trainer_gpus)

    def check_trainer_scale(self, routers: Mapping[str, Any], workers: Any) -> int:
        """Refuse (``ValueError``, nothing changed) a trainer scale below one worker, without
        trainer workers, or needing more than the Ray cluster has free; returns how many
        workers it adds."""
        from opentinker.cluster.ray_env import check_fits
        from opentinker.cluster.trainer_scale import check_scale

        check_scale(workers)
        if not self.trainer_workers:
            raise ValueError(
                "this service trains in its own process: no trainer workers to scale "
                "(serve it with --trainer-workers N)"
            )
        extra = sum(max(0, workers - len(r.pool.open_workers())) for r in routers.values())
        if extra:
            check_fits(extra, *self._trainer_size(), what="trainer worker")
        return extra

    def scale_trainer_workers(self, workers: int) -> dict[str, Any]:
        """Train every base model on ``workers`` trainer workers, while serving: new ones start and
        take new models, removed ones hand each model over (its whole state through the data dir)
        without losing a step (:mod:`opentinker.cluster.trainer_scale`). ``ValueError`` (below
        one, no trainer workers, more than the cluster has free) before anything changes; per
        base model what was added, removed, moved."""
        from opentinker.cluster.trainer_scale import scale_trainers

        folder = self.data_dir / "handover"
        with self._scale_lock:
            routers = self._routers()
            self.check_trainer_scale(routers, workers)
            out = {name: scale_trainers(r, workers, folder / _safe(name)) for name, r in routers.items()}
            self.trainer_workers = workers  # base models loaded later start this many
        return out

    def scale_rollout_workers(self, workers: int) -> dict[str, int]:
        """Serve every base model's sampling from ``workers`` rollout workers, while serving: new
        ones start first and serve the current snapshots, removed ones drain first. Returns the
        count per base model. Raises ``ValueError`` (below one, no worker pool, more than the
        cluster can place) before anything changes."""
        pools = self._worker_pools()
        self.check_rollout_scale(pools, workers)
        out = {name: pool.scale(workers) for name, pool in pools.items()}
        self.rollout_workers = workers  # base models loaded later start this many
        return out

    @staticmethod
    def check_rollout_scale(pools: Mapping[str, WorkerPool], workers: Any) -> int:
        """Refuse (``ValueError``, nothing changed) what :meth:`scale_rollout_workers` cannot do;
        returns how many workers it adds."""
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"rollout workers cannot be scaled below one, got {workers!r}")
        if not pools:
            raise ValueError(
                "this service has no rollout workers to scale (serve it with --rollout-workers N)"
            )
        extra = sum(max(0, workers - p.size) for p in pools.values())
        if extra:
            next(iter(pools.values())).transport.check_capacity(extra)
        return extra

    def scheduler_for(self, name: str, engine: Engine, loop: Callable[[], SamplingService]) -> Scheduler:
        """Base model ``name``'s scheduler, training here or routed to its trainer workers (a lost
        worker's models are then put back by :meth:`worker_lost`), over its rollout service: its
        rollout workers (processes or Ray actors, snapshots sent as bytes) if it has any, else
        ``loop()`` (a sharded group's sampler where its snapshots sample on the group). Its workers of every kind are
        checked against what the cluster has free before any starts."""
        self._check_fits()
        rollout: SamplingService | None = None
        if self.rollout_workers:
            rollout = self.rollout_pool(engine, name)
        elif not self.sample_on_group:
            rollout = loop()
        if not self.trainer_workers:
            return Scheduler(engine, rollout)
        from opentinker.cluster.trainer import TrainerPool
        from opentinker.cluster.trainer_router import RoutedScheduler

        cpus, gpus = self._trainer_size()
        pool = TrainerPool(
            name,
            self.trainer_workers,
            worker_cpus=cpus,
            worker_gpus=gpus,
            device=self.config.device,
            dtype=self.dtype,
            max_rank=self.config.max_rank,
            placement_timeout=self.placement_timeout,
            startup_timeout=self.worker_startup_timeout,
            shard_base=self.shard_base,
        )
        if self.sample_on_group:  # its snapshots sample on the group that trains them
            from opentinker.cluster.shard_sampling import GroupSampling

            rollout = GroupSampling(engine, pool, prefix_cache_bytes=self.config.prefix_cache_bytes)
        router = RoutedScheduler(engine, pool, rollout=rollout)
        router.on_worker_lost = lambda slot, lost: self.worker_lost(router, slot.worker_id, lost)
        return router

    def worker_lost(self, router: Any, worker_id: str, lost: list[str]) -> None:
        """A trainer worker is gone: with ``auto_restore``, each of its models is put back from
        its newest ``save_state`` checkpoint; :attr:`restored` records how (or why not). A lost
        sharded group is rebuilt first on fresh workers where the cluster can place them (else
        its models' reason says how many workers the group needs)."""
        regroup = router.rebuild_group(worker_id) if self.auto_restore and lost else None
        for model_id in lost:
            rec = self.models.get(model_id)
            if rec is None or rec.deleted:
                continue
            lost_at = int(router.steps.get(model_id, 0))
            entry: dict[str, Any] = {"worker": worker_id, "steps_at_loss": lost_at, "restored": False}
            saved = [
                r
                for r in self._checkpoints().list(model_id)
                if r.ref.kind == "weights" and r.meta.get("has_optimizer")
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
                where = router.restore(model_id, str(newest.folder)).result()
            except Exception as e:  # reported, not raised: this runs on a background thread
                entry["reason"] = str(e) if regroup is None else f"{e}; {regroup}"
                self.restored[model_id] = entry
                continue
            rec.parent = newest.ref.tinker_path
            rec.data_parallel, rec.note = where["data_parallel"], where["note"]
            entry.update(
                where, restored=True, checkpoint=newest.ref.tinker_path, lost_steps=max(0, lost_at - step)
            )
            if entry["note"] is None:
                del entry["note"]
            self.restored[model_id] = entry
            _log.warning(
                "trainer worker %s lost: model %s restored from %s on %s; %d step(s) lost%s",
                worker_id, model_id, newest.ref.tinker_path, entry["to_worker"], entry["lost_steps"],
                f"; {where['note']}" if where["note"] else "",
            )  # fmt: skip

    def checkpoint_degree(
        self, eng: Trainer, asked: int | None, meta: Mapping[str, Any]
    ) -> tuple[int, str | None]:
        """The data-parallel degree of a model made from a checkpoint with manifest ``meta``, and
        a note if it is not the one the checkpoint records. ``asked`` (the request's own degree,
        checked by :meth:`data_parallel_degree`) is kept; otherwise
        the recorded degree is kept where the trainer workers can hold it, else the model is
        made on one worker and the note (also logged) says why."""
        if asked is not None:  # a degree the workers cannot hold now is refused where it is made
            return asked, None
        recorded = int(meta.get("data_parallel", 1) or 1)
        if recorded <= 1:
            return 1, None
        dp = eng.data_parallel
        why = "this service trains in its own process" if dp is None else dp.data_parallel_shortfall(recorded)
        if why is None:
            return recorded, None
        note = f"the checkpoint was data-parallel over {recorded} trainer workers, made on one worker: {why}"
        _log.warning("%s: %s", meta.get("tinker_path", "a checkpoint"), note)
        return 1, note

    def trainer_stats(self, name: str) -> dict[str, Any]:
        """Base model ``name``'s trainer workers and the models auto-restore put back (empty
        when it trains in this process): part of :meth:`Runtime.engine_stats`."""
        router = self._routers().get(name)
        if router is None:
            return {}
        restored = {
            m: e for m, e in self.restored.items() if (r := self.models.get(m)) and r.base_model == name
        }
        return {"trainer_workers": router.trainer_info(), "restored": restored}


def data_parallel_of(eng: Trainer) -> DataParallelTrainer:
    """``eng``'s data-parallel operations; an error where models train in this process."""
    if eng.data_parallel is None:
        raise EngineError("data parallelism needs trainer workers (serve with --ray --trainer-workers N)")
    return eng.data_parallel


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
