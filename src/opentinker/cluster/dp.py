"""One model across several trainer workers: data parallelism for a model whose batches outgrow
one device.

``DataParallelModel(pool, model_id, config, degree=k)`` creates the same adapter (same LoRA
config and seed, so the same initial weights) on k workers of a :class:`~opentinker.cluster.trainer.TrainerPool`
(the least loaded live ones; workers added to the pool later count alike) and a process group of
those k alone (its store hosted by replica 0's worker). Its ``forward_backward`` splits the datums into k contiguous
shards, one per replica, run at once; each replica accumulates its shard's LoRA gradients. Its
``optim_step`` all-reduces (sums) those gradients inside the actors (gloo on CPU, NCCL on GPU),
then every replica takes the same AdamW step. Losses are token sums and each datum is
self-contained, so the sum of the shards' gradients is the whole batch's gradient: the result
equals the one-worker run within fp32 rounding (the shards are padded and summed in another
order). The merged result lists every datum's outputs in the caller's order; ``loss:sum`` (and
any ``:sum`` metric) is the sum over shards, ``:mean`` metrics their datum-weighted mean.

A request is checked before any shard runs; a shard the engine still refuses (a non-finite loss
on its data) puts back the gradients the other shards just accumulated, so the replicas never
disagree. A model's operations run one at a time, in call order (a lock per model), which is
also what keeps each replica's collectives in the same order.

Served over the router (:class:`~opentinker.cluster.trainer_router.RoutedScheduler`, a model
created with a data-parallel degree through the SDK or `serve --data-parallel K`): reads, checkpoints
and snapshots are replica 0's (every replica holds the same weights and optimizer state); loads
and weight copies go into every replica. ``checkpoint=`` makes the model from a checkpoint (on
storage every worker reads), each replica loading it.

Worker loss: once a replica's worker is lost, every op of the model raises
:class:`~opentinker.cluster.trainer.WorkerLostError` naming the worker and the model, at once
(an op in flight when it died too: an optimizer step does not wait for the other replicas'
all-reduce, which cannot complete, to time out). :meth:`DataParallelModel.discard` then frees
what the live replicas hold, so the model can be made again from its newest checkpoint.
:func:`shortfall` says why a pool cannot hold a new data-parallel model of some degree now
(fewer live workers than the degree).

Handover (a trainer worker holding a replica is removed, :mod:`opentinker.cluster.trainer_scale`):
:meth:`DataParallelModel.hand_out` saves replica 0's whole state (weights, optimizer state and
step, snapshot count and lineage) and, as the pending gradients, the sum of every replica's
(one all-reduce, the one the next optimizer step would do); the model is deleted from its
replicas and made again under the same id at the same degree on workers not leaving, every
replica loading the state and :meth:`DataParallelModel.take_over` giving replica 0 the summed
gradients and the others none. The next all-reduce then gives the same sum, so the training goes
on bit for bit as it would have without the move.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from opentinker.cluster.shard import merge_results, shard_sizes
from opentinker.cluster.trainer import TrainerPool, WorkerLostError, WorkerSlot, ray_module
from opentinker.engine import AdamParams, EngineError, ForwardRequest, ForwardResult
from opentinker.engine.validate import validate_request
from opentinker.lora import LoRAConfig


def shortfall(pool: TrainerPool, degree: int) -> str | None:
    """Why ``pool`` cannot hold a new data-parallel model of ``degree`` now, or None if it can."""
    live = len(pool.open_workers())
    if degree > live:
        lost = [w.worker_id for w in pool.workers if not w.alive]
        gone = f"; lost: {', '.join(lost)}" if lost else ""
        return f"data-parallel degree {degree} is above the number of live trainer workers ({live}{gone})"
    return None


class DataParallelModel:
    """One adapter replicated over ``degree`` trainer workers (module docstring): fresh from
    ``config`` (which needs a seed), or loaded from the checkpoint folder ``checkpoint`` (with its
    optimizer state if ``optimizer``; ``config`` is then unused). ``on``: the replicas' workers,
    in order, instead of the least loaded live ones (a handover puts a model back where it was
    with it)."""

    def __init__(
        self,
        pool: TrainerPool,
        model_id: str,
        config: LoRAConfig | None,
        *,
        degree: int,
        checkpoint: str | None = None,
        optimizer: bool = True,
        on: list[WorkerSlot] | None = None,
    ) -> None:
        if not isinstance(degree, int) or degree < 1:
            raise EngineError(f"the data-parallel degree must be an integer >= 1, got {degree!r}")
        why = shortfall(pool, degree) if on is None else None
        if why is not None:
            raise EngineError(why)
        if checkpoint is None and (config is None or config.seed is None):
            raise EngineError(
                "a data-parallel model needs a LoRA seed: every replica starts from the same weights"
            )
        live = pool.open_workers()
        ray = ray_module()
        self.pool, self.model_id, self.config = pool, model_id, config
        self.replicas: list[WorkerSlot] = sorted(live, key=lambda w: (len(w.models), w.rank))[:degree]
        if on is not None:  # where it was (a handover undone): live workers, draining or not
            if len(on) != degree or not all(w.alive for w in on):
                raise EngineError(f"{len(on)} replica workers given for data-parallel degree {degree}")
            self.replicas = list(on)
        self._limits = pool.limits
        self._lock = threading.Lock()
        self._seqs: dict[int, int] = {}  # replica rank -> the next sequence number (:meth:`_next`)
        pool.reserve(model_id, self.replicas)
        try:
            address, port = ray.get(self.replicas[0].actor.rendezvous.remote())
            ray.get(
                [
                    w.actor.join_data_parallel.remote(model_id, address, port, i, degree)
                    for i, w in enumerate(self.replicas)
                ]
            )
            if checkpoint is None:
                self._all(lambda w: w.actor.create_adapter.remote(model_id, config))
            else:
                kwargs = {"adapter_id": model_id, "optimizer": optimizer}
                self._all(
                    lambda w: w.actor.submit.remote(
                        model_id, None, "call", "load_state", (checkpoint,), kwargs
                    )
                )
        except Exception:
            self.discard()  # all or nothing: no replica keeps a half-made model
            raise

    @property
    def degree(self) -> int:
        return len(self.replicas)

    def forward_backward(
        self,
        examples: list[Any],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, float] | None = None,
        *,
        backward: bool = True,
    ) -> ForwardResult:
        """The datums split over the replicas (gradients accumulate on each until ``optim_step``)."""
        req = ForwardRequest(self.model_id, list(examples), loss_fn, dict(loss_fn_config or {}), backward)
        if req.custom_loss is not None:
            raise EngineError("custom losses are not served data-parallel")
        validate_request(req, **self._limits)  # a bad request fails here, before any replica runs
        self.check_live()
        sizes = shard_sizes(len(req.examples), self.degree)
        with self._lock:
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            jobs = [
                (w, n, w.actor.dp_forward_backward.remote(
                    self.model_id,
                    ForwardRequest(self.model_id, req.examples[s : s + n], loss_fn, req.loss_fn_config, backward),
                ))
                for w, s, n in zip(self.replicas, starts, sizes, strict=True)
                if n
            ]  # fmt: skip
            parts: list[ForwardResult] = []
            failure: BaseException | None = None
            done: list[WorkerSlot] = []
            for w, _, ref in jobs:
                try:
                    parts.append(self.pool.get(w, self.model_id, ref))
                    done.append(w)
                except EngineError as e:
                    failure = failure or e
            if failure is not None:
                self._all(lambda w: w.actor.dp_revert.remote(self.model_id), among=done)
                raise failure
        return merge_results(parts, [n for _, n, _ in jobs])

    def optim_step(self, params: AdamParams) -> dict[str, float]:
        """Sum the replicas' gradients (all-reduce in the actors), then the same step on each."""
        params.validate()
        self.check_live()
        with self._lock:
            results = self._all(lambda w: w.actor.dp_optim_step.remote(self.model_id, params))
        return results[0]

    def weights(self, replica: int = 0) -> dict[str, Any]:
        """A CPU copy of one replica's adapter weights."""
        w = self.replicas[replica]
        return self.pool.get(w, self.model_id, w.actor.adapter_state.remote(self.model_id))

    def delete(self) -> None:
        if self.lost() is not None:  # what the live replicas hold is freed; the lost one's went with it
            self.discard()
            return
        with self._lock:
            self._all(lambda w: w.actor.delete_adapter.remote(self.model_id))
        self.pool.release(self.model_id, self.replicas)

    # ------------------------------------------------------------------ handover
    def hand_out(self, folder: str) -> int:
        """Save the model's whole state to ``folder`` (storage every worker reads) for
        :meth:`take_over` on new replicas: replica 0's weights, optimizer state, step, snapshot
        count and lineage, and as the pending gradients the sum of every replica's (their
        all-reduce, as the next optimizer step would do it). Returns the optimizer step. The
        replicas keep the model (:meth:`delete` frees them)."""
        self.check_live()
        with self._lock:
            steps = self._all(
                lambda w: w.actor.dp_hand_out.remote(self.model_id, folder if w is self.replicas[0] else None)
            )
        return int(steps[0])

    def take_over(self, folder: str) -> int:
        """Complete a model made from ``folder``'s ``state`` (:meth:`hand_out`'s): every replica
        takes the lineage, replica 0 the summed gradients (the others none: the next all-reduce
        sums them to the same gradients, so the next step is the one the old replicas would
        have taken). Returns the optimizer step."""
        self.check_live()
        with self._lock:
            steps = self._all(
                lambda w: w.actor.dp_take_over.remote(self.model_id, folder, gradients=w is self.replicas[0])
            )
        return int(steps[0])

    # ------------------------------------------------------------------ worker loss
    def lost(self) -> WorkerSlot | None:
        """The first replica whose worker is lost, if any."""
        return next((w for w in self.replicas if not w.alive), None)

    def check_live(self) -> None:
        """Raise :class:`WorkerLostError` naming the worker and the model if a replica is lost."""
        w = self.lost()
        if w is not None:
            raise WorkerLostError(
                f"trainer worker {w.worker_id} was lost ({w.lost_reason}) with data-parallel model "
                f"{self.model_id!r} (replica {self.replicas.index(w) + 1} of {self.degree}); "
                "restore it from its newest checkpoint"
            )

    def discard(self) -> None:
        """After a replica's loss: drop the adapter from the live replicas (each keeps its side of
        the process group: a peer is gone, and a collective of it may still be pending) and free
        the model's places in the pool. Best effort: a replica that fails to answer is left as is."""
        live = [w for w in self.replicas if w.alive]
        refs = [(w, w.actor.dp_discard.remote(self.model_id)) for w in live]
        for w, ref in refs:
            with contextlib.suppress(Exception):  # lost meanwhile: nothing left there to free
                self.pool.get(w, self.model_id, ref)
        self.pool.release(self.model_id, self.replicas)

    # ------------------------------------------------------------------ served over the router
    def forward_request(self, req: ForwardRequest) -> ForwardResult:
        """:meth:`forward_backward` of a routed ``ForwardRequest`` for this model."""
        return self.forward_backward(req.examples, req.loss_fn, req.loss_fn_config, backward=req.backward)

    def read(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``Engine.method`` on replica 0 (what the model's state reads and checkpoints are: the
        replicas hold the same weights and optimizer state)."""
        self.check_live()
        w = self.replicas[0]
        with self._lock:
            return self.pool.get(
                w, self.model_id, w.actor.submit.remote(self.model_id, None, "call", method, args, kwargs)
            )

    def load(self, folder: str, *, optimizer: bool) -> str:
        """A checkpoint's weights (and optimizer state) into every replica."""
        self.check_live()
        with self._lock:
            self._all(
                lambda w: w.actor.submit.remote(
                    self.model_id, None, "call", "load_state", (folder,), {"optimizer": optimizer, "into": self.model_id}
                )
            )  # fmt: skip
        return self.model_id

    def adopt(self, weights: Any, *, step: int, parent: str | None) -> str:
        """A copy of ``weights`` (CPU ``LoRAWeights``) into every replica, with fresh optimizers."""
        self.check_live()
        with self._lock:
            self._all(
                lambda w: w.actor.adopt.remote(
                    self.model_id, self._next(w), weights, step=step, parent=parent, into=True
                )
            )
        return self.model_id

    def snapshot(self) -> tuple[Any, Any]:
        """Replica 0's snapshot: its info and its weights (CPU)."""
        self.check_live()
        w = self.replicas[0]
        with self._lock:
            return self.pool.get(w, self.model_id, w.actor.snapshot.remote(self.model_id, self._next(w)))

    def _next(self, w: WorkerSlot) -> int:
        """The model's next sequence number on replica ``w`` (for the worker's ordered calls; only
        this model's own calls, one at a time under its lock, count on it)."""
        seq = self._seqs.get(w.rank, 0)
        self._seqs[w.rank] = seq + 1
        return seq

    def _all(self, call: Any, among: list[WorkerSlot] | None = None) -> list[Any]:
        """One call on every replica (or ``among``) at once; wait for all, then raise the first
        error, in replica order. A lost worker raises at once: the other replicas may be waiting
        for it in a collective that can no longer complete."""
        slots = self.replicas if among is None else among
        refs = [call(w) for w in slots]
        pending = dict(zip(refs, range(len(slots)), strict=True))
        out: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        ray = ray_module()
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                i = pending.pop(ref)
                try:
                    out[i] = self.pool.get(slots[i], self.model_id, ref)
                except WorkerLostError:
                    raise
                except Exception as e:
                    errors[i] = e
        if errors:
            raise errors[min(errors)]
        return [out[i] for i in range(len(slots))]
