"""The front-end's side of the trainer workers: a scheduler that routes each model's training to
the trainer worker holding it, for a ``Runtime`` that serves training from a
:class:`~opentinker.cluster.trainer.TrainerPool`.

:class:`RoutedScheduler` has the :class:`~opentinker.scheduler.Scheduler`'s interface, so the
clients, the runtime and the HTTP server run unchanged over it. It *is* a scheduler over the
front-end's own engine (a base-model replica that trains nothing): that engine holds the policy
versions samplers read (every snapshot a worker takes comes back as the adapter's tensors and is
registered there), serves sampling (its sampling loop or rollout workers, as without Ray), and
runs the calls of queues that name no placed model (releasing a snapshot, loading a checkpoint
as a policy).

Every other operation of a model goes, in the model's submission order, to its worker:
``forward_backward`` and ``optim_step`` are sent without waiting (a pipelined pair meets in one
tick of the worker's scheduler, fused with the other adapters it holds); a queued call
(``fn(engine)``: save, load, snapshot, delete, ...) runs on the front-end with an
:class:`~opentinker.cluster.routed_trainer.RoutedTrainer` as its trainer, whose model operations run
on the model's worker, in order.
Each model has a *lane*: its operations start one after another, and each remote op carries the
model's sequence number, which the worker uses to queue them in order
(:meth:`TrainerWorker.submit`).

A model whose worker is lost answers :class:`~opentinker.cluster.trainer.WorkerLostError` for
the requests in flight and every later one, at once. ``on_worker_lost`` (set by the runtime) is
told the models it held, once per lost worker: with ``--auto-restore`` the runtime puts each back
from its newest checkpoint.

A data-parallel model (created with a degree k > 1: the SDK's ``user_metadata`` ``{"data_parallel":
"k"}`` or ``serve --data-parallel k``) is a :class:`~opentinker.cluster.dp.DataParallelModel` over k
workers, routed by itself: its lane runs each op to its end (``forward_backward`` split over the
replicas, ``optim_step`` after the all-reduce), reads and checkpoints are replica 0's, loads go into
every replica. A data-parallel model whose replica's worker is lost answers the same
``WorkerLostError`` for every op; ``restore`` puts it back at its degree where the pool can
still hold it (:func:`~opentinker.cluster.dp.shortfall`), else on one worker, saying why.
``hand_over`` of a data-parallel model (a worker holding a replica is removed) makes it again at
its degree on workers that stay, in its lane, with its whole state and pending gradients.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from opentinker.cluster.dp import DataParallelModel, shortfall
from opentinker.cluster.routed_trainer import RoutedTrainer
from opentinker.cluster.trainer import (
    ClusterConfigError,
    TrainerPool,
    WorkerLostError,
    WorkerSlot,
    ray_module,
)
from opentinker.engine import AdamParams, Engine, EngineError, ForwardRequest
from opentinker.engine.trainer import Trainer
from opentinker.sampling.handles import SamplingService
from opentinker.scheduler import ModelQueue, QueueKey, Scheduler


class _Lane:
    """One model's operations, started one after another."""

    def __init__(self) -> None:
        self.ops: deque[tuple[Callable[[], None], Future]] = deque()
        self.busy = False
        self.seq = 0  # the next sequence number on its current worker
        self.worker: int | None = None  # the rank the numbering counts on


class RoutedScheduler(Scheduler):
    """A scheduler whose models train on trainer workers (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        pool: TrainerPool,
        *,
        rollout: SamplingService | None = None,
        lanes: int = 32,
    ) -> None:
        super().__init__(engine, rollout)
        self.pool = pool
        self.on_worker_lost: Callable[[WorkerSlot, list[str]], None] | None = None
        self._lanes: dict[str, _Lane] = {}
        self._lane_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(lanes, thread_name_prefix="opentinker-lane")
        self._reported: set[int] = set()  # lost workers already reported
        self._names = itertools.count(1)
        self.steps: dict[str, int] = {}  # model -> optimizer steps taken (what a loss would lose)
        self.dp: dict[str, DataParallelModel] = {}  # data-parallel models, routed by themselves

    # ------------------------------------------------------------------ submission
    def submit_forward(self, model_id: str, req: ForwardRequest) -> Future:
        return self._enqueue(model_id, lambda fut: self._send(model_id, "forward", req, fut))

    def submit_optim(self, model_id: str, params: AdamParams) -> Future:
        return self._enqueue(model_id, lambda fut: self._send(model_id, "optim", params, fut))

    def submit_call(self, key: QueueKey, fn: Callable[[Trainer], Any]) -> Future:
        if not isinstance(key, ModelQueue):  # a version's: a snapshot's release, a checkpoint served
            return super().submit_call(key, fn)
        model_id = key.model_id

        def run(fut: Future) -> None:
            try:
                fut.set_result(fn(RoutedTrainer(self, model_id)))
            except Exception as e:
                fut.set_exception(self._translate(e))

        return self._enqueue(model_id, run)

    def _enqueue(self, model_id: str, start: Callable[[Future], None]) -> Future:
        self._check_open()
        fut: Future = Future()
        with self._lane_lock:
            lane = self._lanes.setdefault(model_id, _Lane())
            lane.ops.append((lambda: start(fut), fut))
            if lane.busy:
                return fut
            lane.busy = True
        self._executor.submit(self._drain, lane)
        return fut

    def _drain(self, lane: _Lane) -> None:
        while True:
            with self._lane_lock:
                if not lane.ops:
                    lane.busy = False
                    return
                start, fut = lane.ops.popleft()
            try:
                start()
            except Exception as e:  # a bug in routing must fail the request, never the lane
                if not fut.done():
                    fut.set_exception(self._translate(e))

    # ------------------------------------------------------------------ remote ops
    def next_seq(self, model_id: str, slot: WorkerSlot) -> int:
        """The model's next sequence number on ``slot`` (restarting at 0 on a new worker)."""
        with self._lane_lock:
            lane = self._lanes.setdefault(model_id, _Lane())
            if lane.worker != slot.rank:
                lane.worker, lane.seq = slot.rank, 0
            seq = lane.seq
            lane.seq += 1
            return seq

    def _send(self, model_id: str, kind: str, payload: Any, fut: Future) -> None:
        """Send one forward/optim op to the model's worker; ``fut`` settles when it is done."""
        dp = self.dp.get(model_id)
        if dp is not None:
            self._dp_send(dp, kind, payload, fut)
            return
        try:
            slot = self.pool.worker_of(model_id)
        except EngineError as e:
            fut.set_exception(e)
            return
        ref = slot.actor.submit.remote(model_id, self.next_seq(model_id, slot), kind, payload)
        ref.future().add_done_callback(lambda f: self._settle(slot, model_id, kind, f, fut))

    def _dp_send(self, dp: DataParallelModel, kind: str, payload: Any, fut: Future) -> None:
        """A data-parallel model's forward/optim op, run to its end in the model's lane."""
        try:
            out = dp.forward_request(payload) if kind == "forward" else dp.optim_step(payload)
        except Exception as e:
            fut.set_exception(self._translate(e))
            return
        if kind == "optim":
            with self._lane_lock:
                self.steps[dp.model_id] = self.steps.get(dp.model_id, 0) + 1
        fut.set_result(out)

    def call(
        self, model_id: str, slot: WorkerSlot, method: str, *args: Any, ordered: bool = True, **kwargs: Any
    ) -> Any:
        """Run ``Engine.method`` on ``slot`` for ``model_id`` and wait (in its order if ``ordered``)."""
        seq = self.next_seq(model_id, slot) if ordered else None
        return self.pool.get(
            slot, model_id, slot.actor.submit.remote(model_id, seq, "call", method, args, kwargs)
        )

    def _settle(self, slot: WorkerSlot, model_id: str, kind: str, done: Future, fut: Future) -> None:
        try:
            out = done.result()
        except Exception as e:
            fut.set_exception(self._translate(e, slot, model_id))
            return
        if kind == "optim":
            with self._lane_lock:
                self.steps[model_id] = self.steps.get(model_id, 0) + 1
        fut.set_result(out)

    def restore(self, model_id: str, folder: str) -> Future:
        """Put ``model_id``, whose worker was lost, back from the checkpoint in ``folder``
        (weights and optimizer state) on the least-loaded live worker, in the model's order:
        its later requests run there. A data-parallel model comes back at its degree where the
        pool can hold it, else on one worker. The future gives a dict: ``to_worker`` (the new
        worker's id; a data-parallel model's, comma-separated), ``data_parallel`` (its degree now)
        and ``note`` (why the degree was not kept, or None)."""

        def run(fut: Future) -> None:
            try:
                fut.set_result(self._restore(model_id, folder))
            except Exception as e:
                fut.set_exception(self._translate(e))

        return self._enqueue(model_id, run)

    def _restore(self, model_id: str, folder: str) -> dict[str, Any]:
        lost = self.dp.get(model_id)
        note: str | None = None
        if lost is not None:
            if lost.lost() is None:
                raise EngineError(f"model {model_id!r} is live on its trainer workers; nothing to restore")
            lost.discard()
            del self.dp[model_id]
            why = shortfall(self.pool, lost.degree)
            try:
                if why is None:
                    dp = DataParallelModel(self.pool, model_id, None, degree=lost.degree, checkpoint=folder)
                    self.dp[model_id] = dp
                    self.note_step(model_id, int(dp.read("adapter_step", model_id)))
                    return {
                        "to_worker": ",".join(w.worker_id for w in dp.replicas),
                        "data_parallel": dp.degree,
                        "note": None,
                    }
                note = f"data-parallel degree {lost.degree} not kept ({why}): restored on one worker"
                return {**self._restore_plain(model_id, folder), "note": note}
            except Exception:
                self.dp.setdefault(model_id, lost)  # still answers the loss of its worker
                raise
        return {**self._restore_plain(model_id, folder), "note": None}

    def _restore_plain(self, model_id: str, folder: str) -> dict[str, Any]:
        slot, old = self.pool.move_lost(model_id)
        try:
            self.call(model_id, slot, "load_state", folder, adapter_id=model_id, optimizer=True)
            self.note_step(model_id, int(self.call(model_id, slot, "adapter_step", model_id)))
        except Exception as e:
            self.pool.undo_move(model_id, slot, old)
            raise self._translate(e, slot, model_id) from None
        return {"to_worker": slot.worker_id, "data_parallel": 1}

    def rebuild_group(self, worker_id: str) -> str | None:
        """Where ``worker_id`` led a sharded group now lost, a new group of fresh workers in its
        place (:meth:`TrainerPool.rebuild_group`; the lost group's models are then restored onto
        it). None when it was rebuilt (or was no lost group), else why not: how many workers it
        needs and what the cluster has."""
        slot = next((w for w in self.pool.workers if w.worker_id == worker_id), None)
        if slot is None or not slot.group or slot.alive:
            return None
        try:
            self.pool.rebuild_group(slot)
        except (ClusterConfigError, EngineError) as e:
            return str(e)
        return None

    def hand_over(self, model_id: str, folder: str) -> Future:
        """Move ``model_id`` off its worker (one being removed) without losing a step, in the
        model's order: the ops sent before finish there, then its whole state goes through
        ``folder`` (storage every worker reads: :meth:`TrainerWorker.hand_out`) onto the least
        loaded other worker, and routing switches; the ops queued behind wait in its lane
        meanwhile and then run on the new worker. The future gives the new worker's id and the
        model's optimizer step at the move (None: the model was deleted meanwhile).

        A data-parallel model is made again at its degree on workers not leaving
        (:meth:`_dp_hand_over`); the future then gives its new workers' ids, comma-separated."""

        def run(fut: Future) -> None:
            if model_id in self.dp:
                try:
                    fut.set_result(self._dp_hand_over(model_id, folder))
                except Exception as e:
                    fut.set_exception(self._translate(e))
                return
            if not self.pool.is_placed(model_id):
                fut.set_result(None)
                return
            try:
                old = self.pool.worker_of(model_id)
                target = self.pool.begin_move(model_id)
            except EngineError as e:
                fut.set_exception(e)
                return
            try:
                ref = old.actor.hand_out.remote(model_id, self.next_seq(model_id, old), folder)
                self.pool.get(old, model_id, ref)
                step = int(self.pool.get(target, model_id, target.actor.take_over.remote(model_id, folder)))
                with self._lane_lock:
                    lane = self._lanes.setdefault(model_id, _Lane())
                    lane.worker, lane.seq = target.rank, 0  # take_over started its numbering at 0
                self.pool.finish_move(model_id, target)
                self.note_step(model_id, step)
                fut.set_result((target.worker_id, step))
            except Exception as e:
                self.pool.abort_move(model_id, target)
                fut.set_exception(self._translate(e, old, model_id))

        return self._enqueue(model_id, run)

    def _dp_hand_over(self, model_id: str, folder: str) -> tuple[str, int]:
        """Data-parallel model ``model_id`` (in its lane: no op of it runs meanwhile) off its
        workers: its whole state and the sum of its replicas' pending gradients go through
        ``folder`` (:meth:`DataParallelModel.hand_out`), its replicas are freed, and it is made
        again under the same id at the same degree on the least loaded live workers not
        draining, each replica loading the state and replica 0 the gradients; then routing
        switches. If it cannot be made there it is made again where it was, from the same
        folder, and the call raises saying why (its workers are then kept)."""
        old = self.dp[model_id]
        step = old.hand_out(folder)  # refused: nothing changed, the model stays where it is
        state = str(Path(folder) / "state")
        new: DataParallelModel | None = None
        try:
            old.delete()
            new = DataParallelModel(self.pool, model_id, None, degree=old.degree, checkpoint=state)
            new.take_over(folder)
        except Exception as e:
            if new is not None:
                new.discard()
            old.discard()  # whatever a failed delete left on the old replicas
            back = DataParallelModel(
                self.pool, model_id, None, degree=old.degree, checkpoint=state, on=old.replicas
            )
            back.take_over(folder)
            self.dp[model_id] = back
            raise EngineError(
                f"data-parallel model {model_id!r} could not be made again on other trainer workers "
                f"({e}); it stays on {', '.join(w.worker_id for w in old.replicas)}"
            ) from e
        self.dp[model_id] = new
        self.note_step(model_id, step)
        return ",".join(w.worker_id for w in new.replicas), step

    def fresh(self) -> int:
        """A number not given before (new adapter ids, renumbered snapshots)."""
        return next(self._names)

    def note_step(self, model_id: str, step: int) -> None:
        """The optimizer steps ``model_id`` has taken (known at its creation or load)."""
        with self._lane_lock:
            self.steps[model_id] = step

    def _translate(
        self, e: BaseException, slot: WorkerSlot | None = None, model_id: str = ""
    ) -> BaseException:
        """Ray's errors as ours: the engine's own error, or the loss of the worker (reported once)."""
        ray = ray_module()
        if isinstance(e, ray.exceptions.RayTaskError):
            cause = getattr(e, "cause", None)
            if not isinstance(cause, BaseException):
                return e
            if slot is not None:  # a sharded group's leader naming its lost member: the group is lost
                self.pool.note_group_loss(slot, cause)
            e = cause
        if isinstance(e, ray.exceptions.RayActorError) and slot is not None and slot.group:
            self.pool.mark_lost(slot, type(e).__name__)
            self.pool.group_lost(slot, slot.worker_id)  # its leader: the group goes with it
            e = slot.lost_error(model_id)
        elif isinstance(e, ray.exceptions.RayActorError) and slot is not None:
            self.pool.mark_lost(slot, type(e).__name__)
            e = WorkerLostError(
                f"{slot.label} was lost while serving model {model_id!r}; "
                "restore it from its newest checkpoint"
            )
        if isinstance(e, WorkerLostError):
            self._report_losses()
        return e

    def _report_losses(self) -> None:
        for slot in self.pool.workers:
            if slot.alive or slot.rank in self._reported:
                continue
            self._reported.add(slot.rank)
            models = sorted(slot.models)
            if self.on_worker_lost is not None:
                threading.Thread(target=self.on_worker_lost, args=(slot, models), daemon=True).start()

    def trainer_info(self) -> list[dict[str, Any]]:
        """Each trainer worker: alive or lost, how many models it holds, its ticks (live ones)."""
        ray = ray_module()
        out = []
        for w in self.pool.workers:
            entry: dict[str, Any] = {
                "worker_id": w.worker_id,
                "alive": w.alive,
                "models": len(w.models),
                "model_ids": sorted(w.models),
            }
            if w.alive:
                try:
                    info = ray.get(w.actor.info.remote(), timeout=10)
                    entry.update(ticks=info["ticks"], queued=info["queued"])
                except Exception as e:  # lost since: say so, never fail the reader
                    entry.update(alive=False, error=type(e).__name__)
            else:
                entry["lost"] = w.lost_reason
            out.append(entry)
        return out

    def shutdown(self) -> None:
        super().shutdown()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.pool.shutdown()
