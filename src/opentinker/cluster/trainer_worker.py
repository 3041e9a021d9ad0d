"""A trainer worker: the body of one Ray actor holding a base-model replica, a shard of the
adapters, its own scheduler (fused ticks over the adapters it holds) and their optimizer state.

The actor is threaded (``max_concurrency``): every call blocks one of its threads on a scheduler
future, so concurrent calls for different adapters meet in the same tick and share one fused
forward/backward, as they do in one process. What travels in and out is plain engine types
(``ForwardRequest``, ``ForwardResult``, ``AdamParams``, ``LoRAConfig``) and CPU tensors; Ray pickles
them, and tensors go through its object store.

Data parallelism (:mod:`opentinker.cluster.dp`) adds one process group per data-parallel model:
each replica runs its shard's forward/backward in its own ticks like any request, and at the
optimizer step sums the adapter's gradients with the other replicas' (``torch.distributed``
all-reduce: gloo on CPU, NCCL on GPU) before the same AdamW step, so the replicas stay identical.
The all-reduce runs on the calling actor thread, not the scheduler's, so a replica waiting for its
peers never holds up the ticks of the other adapters it serves.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from opentinker.cluster.shard import (
    MIRRORED,
    ShardedEngine,
    check_shardable,
    gather_seconds,
    release_host_memory,
    shard_model,
)
from opentinker.cluster.shard_load import checkpoint_names, materialise
from opentinker.cluster.shard_sampling import GroupSamplingMember
from opentinker.engine import AdamParams, Engine, EngineError, ForwardRequest, ForwardResult
from opentinker.engine.checkpoint import read_checkpoint, read_manifest, write_checkpoint
from opentinker.lora import LoRAConfig, LoRAWeights
from opentinker.models import load_base_model
from opentinker.scheduler import ModelQueue, Scheduler

# the Engine methods a router may run on a worker for a model it placed there
ENGINE_CALLS = frozenset(
    {
        "create_adapter", "load_state", "delete_adapter", "save_state", "export_peft", "export_tinker",
        "export_merged",
        "adapter_config", "adapter_step", "adapter_weights", "optimizer_state", "pending_gradients",
        "set_pending_gradients", "optim_step", "forward_backward", "forward_backward_many",
    }
)  # fmt: skip
GRADIENTS_FILE = "gradients.safetensors"  # a handed-over model's gradients since its last step
COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a peer that never joins fails the step, not hangs it


class TrainerWorker(GroupSamplingMember):
    """One replica of ``base_model`` serving the adapters placed on it (see the module docstring)."""

    def __init__(
        self,
        base_model: str,
        *,
        worker_id: str,
        device: str = "cpu",
        dtype: str = "float32",
        max_rank: int = 128,
        threads: int = 1,
        shard_base: int = 1,
    ) -> None:
        torch.set_num_threads(max(1, threads))
        self.worker_id = worker_id
        self.device = device
        # a sharded group's worker builds its base on the meta device (no weight read) and reads
        # only its own shard of the weights when the group forms (shard_join; cluster/shard_load.py)
        base = load_base_model(base_model, dtype=dtype, device="meta" if shard_base > 1 else device)
        self._weight_names = checkpoint_names(base.model) if shard_base > 1 else []
        self.engine = (ShardedEngine if shard_base > 1 else Engine)(base, max_rank=max_rank, device=device)
        # sampling is the rollout workers' job: this scheduler serves none
        self.scheduler = Scheduler(self.engine)
        self._groups: dict[str, Any] = {}  # data-parallel model -> (its process group, its store)
        self._kept: dict[str, dict[str, torch.Tensor] | None] = {}  # gradients before the last shard
        self._order = threading.Condition()
        self._next_seq: dict[str, int] = {}  # model -> the sequence number it submits next

    # ------------------------------------------------------------------ what the router reads
    def info(self) -> dict[str, Any]:
        """Who this worker is, what it holds and what waits in its queues."""
        return {
            "worker_id": self.worker_id,
            "pid": os.getpid(),
            "node": _node_ip(),
            "base_model": self.engine.base.name,
            "adapters": self.engine.adapter_ids(),
            "queued": sum(self.scheduler.queue_depths().values()),
            "ticks": self.scheduler.stats.ticks,
            "base_bytes": _local_bytes(self.engine.base.model),  # a sharded base: this worker's share
            "limits": {
                "vocab_size": self.engine.vocab_size,
                "max_context": self.engine.max_context,
                "max_batch_tokens": self.engine.max_batch_tokens,
            },
        }

    # ------------------------------------------------------------------ a data-parallel replica's ops
    def create_adapter(self, model_id: str, config: LoRAConfig) -> str:
        return self._call(model_id, lambda eng: eng.create_adapter(config, model_id))

    def forward_backward(self, model_id: str, req: ForwardRequest) -> ForwardResult:
        """``req`` (for adapter ``model_id``) in the next tick, fused with whatever else is waiting."""
        return _cpu_result(self.scheduler.submit_forward(model_id, req).result())

    def delete_adapter(self, model_id: str) -> None:
        self._call(model_id, lambda eng: eng.delete_adapter(model_id))
        self._kept.pop(model_id, None)
        self._groups.pop(model_id, None)  # its process group and store go with the last reference
        with self._order:  # the model id, made here again (a handover), numbers its ordered ops from 0
            self._next_seq.pop(model_id, None)
            self._order.notify_all()

    def adapter_state(self, model_id: str) -> dict[str, torch.Tensor]:
        """A CPU copy of the adapter's weights (what a replica holds; tests compare them)."""
        return self._call(
            model_id,
            lambda eng: {
                k: v.detach().cpu().clone() for k, v in eng.adapter_weights(model_id).state_dict().items()
            },
        )

    def _call(self, model_id: str, fn: Callable[[Engine], Any]) -> Any:
        return self._submit_call(model_id, fn).result()

    def _submit_call(self, model_id: str, fn: Callable[[Engine], Any]) -> Future:
        """``fn`` in the model's order on the scheduler's thread, given this worker's own engine
        whole (what only an ``Engine`` has: lineage, pending gradients), not the ``Trainer`` seam."""
        return self.scheduler.submit_call(ModelQueue(model_id), lambda _: fn(self.engine))

    # ------------------------------------------------------------------ routed ops, in order
    def submit(
        self,
        model_id: str,
        seq: int | None,
        kind: str,
        payload: Any,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> Any:
        """One op of a routed model: ``forward`` (a ``ForwardRequest``), ``optim`` (``AdamParams``)
        or ``call`` (the ``Engine`` method named ``payload`` with ``args``/``kwargs``).

        The actor runs calls on many threads, so they may start out of order; ``seq`` (the
        model's 0, 1, 2, ... as the router sent them) puts them back in order before they reach
        the scheduler. A model's op n is queued only after op n-1 was, so a ``forward_backward``
        and the ``optim_step`` sent right behind it still meet in one tick. ``seq`` None: a read
        of another model's state, queued at once."""
        if seq is not None:
            with self._order:
                while self._next_seq.get(model_id, 0) != seq:
                    self._order.wait()
        try:
            if kind == "forward":
                fut = self.scheduler.submit_forward(model_id, payload)
            elif kind == "optim":
                fut = self.scheduler.submit_optim(model_id, payload)
            else:
                method = str(payload)
                if method not in ENGINE_CALLS:
                    raise EngineError(f"a trainer worker does not run Engine.{method}")
                fut = self._submit_call(model_id, lambda eng: getattr(eng, method)(*args, **(kwargs or {})))
        finally:
            if seq is not None:
                with self._order:
                    self._next_seq[model_id] = seq + 1
                    self._order.notify_all()
        out = fut.result()
        if isinstance(out, ForwardResult):
            return _cpu_result(out)
        if isinstance(out, LoRAWeights):
            return out.clone(device="cpu")
        return out

    def snapshot(self, model_id: str, seq: int) -> tuple[Any, LoRAWeights]:
        """A snapshot of ``model_id`` in its order: its info and its weights (CPU), sent to the
        router, which serves it for sampling; the worker keeps no copy."""

        def take(eng: Engine) -> tuple[Any, LoRAWeights]:
            info = eng.snapshot(model_id)
            weights = eng.adapter_weights(info.snapshot_id).clone(device="cpu")
            eng.release_snapshot(info.snapshot_id)
            return info, weights

        return self._ordered_call(model_id, seq, take)

    def adopt(
        self, model_id: str, seq: int, weights: Any, *, step: int, parent: str | None, into: bool
    ) -> str:
        """Adapter ``model_id`` (new, or ``into`` the live one) with a copy of ``weights`` (a
        ``LoRAWeights`` from elsewhere: a checkpoint the router holds, another worker's adapter)
        and a fresh optimizer, in its order."""

        def fork(eng: Engine) -> str:
            tmp = f"adopt:{model_id}:{seq}"
            eng.add_snapshot(tmp, weights.clone(device=eng.device), step=step)
            try:
                if into:
                    return eng.fork_adapter(tmp, into=model_id, parent=parent)
                return eng.fork_adapter(tmp, model_id, parent=parent)
            finally:
                eng.release_snapshot(tmp)

        return self._ordered_call(model_id, seq, fork)

    # ------------------------------------------------------------------ handing a model over
    def hand_out(self, model_id: str, seq: int, folder: str) -> None:
        """Save ``model_id``'s whole state to ``folder`` (storage the other workers read), in its
        order, so after every op sent before it: weights, optimizer moments and step
        (``state``, a plain checkpoint whose meta also holds the snapshot count and lineage) and
        the gradients accumulated since its last step, if any (``gradients``). The adapter stays
        here until the worker is stopped (a late read of it still answers)."""

        def save(eng: Engine) -> None:
            lineage = eng.adapter_lineage(model_id)
            eng.save_state(model_id, Path(folder) / "state", optimizer=True, meta={"lineage": lineage})
            grads = eng.pending_gradients(model_id)
            if grads is not None:
                write_checkpoint(Path(folder) / "gradients", {GRADIENTS_FILE: grads}, {"model": model_id})

        self._ordered_call(model_id, seq, save)

    def take_over(self, model_id: str, folder: str) -> int:
        """Adapter ``model_id`` exactly as :meth:`hand_out` saved it in ``folder`` (another
        worker's); returns its optimizer step. Its routed ops number afresh from 0 here (the
        router sends nothing else for it until this returns)."""

        def load(eng: Engine) -> int:
            state = Path(folder) / "state"
            eng.load_state(state, adapter_id=model_id, optimizer=True)
            try:
                _take_rest(eng, model_id, Path(folder), gradients=True)
            except Exception:
                eng.delete_adapter(model_id)  # all or nothing: no half-loaded model stays here
                raise
            return eng.adapter_step(model_id)

        step = self._call(model_id, load)
        with self._order:
            self._next_seq[model_id] = 0
            self._order.notify_all()
        return step

    def _ordered_call(self, model_id: str, seq: int, fn: Callable[[Engine], Any]) -> Any:
        with self._order:
            while self._next_seq.get(model_id, 0) != seq:
                self._order.wait()
        try:
            fut = self._submit_call(model_id, fn)
        finally:
            with self._order:
                self._next_seq[model_id] = seq + 1
                self._order.notify_all()
        return fut.result()

    # ------------------------------------------------------------------ data parallel
    def rendezvous(self) -> tuple[str, int]:
        """An address and a free port on this worker's node, for a process group's store."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return _node_ip(), port

    def join_data_parallel(self, model_id: str, address: str, port: int, rank: int, world: int) -> None:
        """Form ``model_id``'s process group with its other replicas: this worker is member
        ``rank`` of ``world``, and member 0 hosts the group's store at ``address:port`` (what its
        :meth:`rendezvous` gave). Only the replicas take part, all at once, so a group can be
        formed over any live workers at any time, workers started later included."""
        store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=COLLECTIVE_TIMEOUT)
        self._groups[model_id] = (_process_group(store, rank, world, self.device), store)

    def dp_forward_backward(self, model_id: str, req: ForwardRequest) -> ForwardResult:
        """One shard of a data-parallel model's batch; the gradients it had before are kept aside
        until the next shard, so :meth:`dp_revert` can put them back if another shard is refused."""

        def keep(eng: Engine) -> None:
            pending = eng.pending_gradients(model_id)
            self._kept[model_id] = None if pending is None else {k: v.clone() for k, v in pending.items()}

        self._call(model_id, keep)
        return self.forward_backward(model_id, req)

    def dp_revert(self, model_id: str) -> None:
        """Undo this replica's last shard: its gradients as they were before it."""

        def put_back(eng: Engine) -> None:
            kept = self._kept.get(model_id)
            named = eng.adapter_weights(model_id).state_dict()
            eng.set_pending_gradients(
                model_id, kept if kept is not None else {k: torch.zeros_like(v) for k, v in named.items()}
            )

        self._call(model_id, put_back)

    def dp_discard(self, model_id: str) -> None:
        """Drop data-parallel model ``model_id`` after another replica's loss: its adapter goes;
        the process group is only forgotten, not destroyed (a collective on it may still wait for
        the lost peer, and fails on its own: its step is then never taken)."""
        self._groups.pop(model_id, None)
        self._kept.pop(model_id, None)

        def drop(eng: Engine) -> None:
            if eng.has_adapter(model_id):
                eng.delete_adapter(model_id)

        self._call(model_id, drop)
        with self._order:  # the model id, made here again, numbers its ordered ops from 0
            self._next_seq.pop(model_id, None)
            self._order.notify_all()

    def dp_optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        """Sum ``model_id``'s gradients over its replicas, then take the optimizer step (in its order).

        Every replica contributes its accumulated gradients (zeros when its shards were empty);
        one flat all-reduce sums them; each replica sets the sum and steps with the same AdamW
        hyper-parameters, so their weights stay equal."""
        group = self._groups.get(model_id)
        if group is None:
            raise EngineError(f"model {model_id!r} is not data-parallel on worker {self.worker_id}")
        params.validate()  # refused on every replica alike, before any collective starts

        summed = self._summed_gradients(model_id, group)

        def step(eng: Engine) -> dict[str, float]:
            if self._groups.get(model_id) is not group:  # discarded meanwhile (dp_discard)
                raise EngineError(f"data-parallel model {model_id!r} was discarded on {self.worker_id}")
            eng.set_pending_gradients(model_id, summed)
            return eng.optim_step(model_id, params)

        return self._call(model_id, step)

    def _summed_gradients(self, model_id: str, group: Any) -> dict[str, torch.Tensor]:
        """The sum over ``model_id``'s replicas of their accumulated gradients (zeros where a
        replica has none): one flat all-reduce over its process group, every replica calling it."""

        def take(eng: Engine) -> tuple[list[str], list[torch.Tensor]]:
            named = eng.adapter_weights(model_id).state_dict()
            pending = eng.pending_gradients(model_id) or {}
            names = sorted(named)
            return names, [pending[n].detach() if n in pending else torch.zeros_like(named[n]) for n in names]

        names, grads = self._call(model_id, take)
        flat = torch.cat([g.reshape(-1) for g in grads])
        group[0].allreduce([flat]).wait()  # a sum
        summed, offset = {}, 0
        for name, g in zip(names, grads, strict=True):
            summed[name] = flat[offset : offset + g.numel()].view_as(g)
            offset += g.numel()
        return summed

    def dp_hand_out(self, model_id: str, folder: str | None) -> int:
        """This replica's part in handing data-parallel model ``model_id`` over: every replica
        sums the gradients accumulated since the last step (the all-reduce its next optimizer step
        would do, so the same sum, bit for bit); the one given ``folder`` (replica 0) then saves
        what :meth:`hand_out` saves there, its own state and that sum as the gradients. Returns
        the model's optimizer step. The adapter stays here (the model deletes it after)."""
        group = self._groups.get(model_id)
        if group is None:
            raise EngineError(f"model {model_id!r} is not data-parallel on worker {self.worker_id}")
        summed = self._summed_gradients(model_id, group)

        def save(eng: Engine) -> int:
            if folder is not None:
                lineage = eng.adapter_lineage(model_id)
                eng.save_state(model_id, Path(folder) / "state", optimizer=True, meta={"lineage": lineage})
                if any(bool(g.any()) for g in summed.values()):
                    gradients = {k: v.detach().cpu() for k, v in summed.items()}
                    write_checkpoint(
                        Path(folder) / "gradients", {GRADIENTS_FILE: gradients}, {"model": model_id}
                    )
            return eng.adapter_step(model_id)

        return self._call(model_id, save)

    def dp_take_over(self, model_id: str, folder: str, *, gradients: bool) -> int:
        """A new data-parallel replica of ``model_id`` (its weights and optimizer state just
        loaded from ``folder``'s ``state``) takes the rest of what :meth:`dp_hand_out` saved: the
        lineage, and the summed gradients where ``gradients`` (replica 0 only: the others start
        from none, so the next all-reduce gives that sum again). Returns its optimizer step."""

        def load(eng: Engine) -> int:
            _take_rest(eng, model_id, Path(folder), gradients=gradients)
            return eng.adapter_step(model_id)

        return self._call(model_id, load)

    # ------------------------------------------------------------------ a sharded group's member
    def shard_join(
        self, address: str, port: int, rank: int, group: str, worker_ids: list[str], followers: list[Any]
    ) -> None:
        """Join sharded group ``group`` as member ``rank`` of ``worker_ids`` (member 0, its leader,
        hosts the store at ``address:port`` and is given the others' actor handles as
        ``followers``): the group's process group becomes this process's default one, and the
        base model is sharded over it (:mod:`opentinker.cluster.shard`)."""
        eng = self.engine
        if not isinstance(eng, ShardedEngine):
            raise EngineError(f"trainer worker {self.worker_id} was not started for a sharded base")
        world = len(worker_ids)
        check_shardable(eng.base.model, world)
        store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=COLLECTIVE_TIMEOUT)
        backend = "nccl" if torch.device(self.device).type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
        shard_model(eng.base.model, world, self.device)
        materialise(eng.base.model, self._weight_names, eng.base.path, self.device)
        self._weight_names = []
        eng.join(rank, world, group, worker_ids, followers)

    def shard_forward(self, share: list[ForwardRequest], tick: list[str], need_grad: bool) -> list[Any]:
        """This member's share of its leader's tick (:meth:`ShardedEngine.run_share`)."""
        eng = self.engine
        assert isinstance(eng, ShardedEngine)
        out = self._call("", lambda _: eng.run_share(share, tick, need_grad))
        return [r if isinstance(r, BaseException) else _cpu_result(r) for r in out]

    def shard_call(self, method: str, args: tuple, kwargs: dict) -> Any:
        """A state-changing ``Engine`` call the leader ran, run here too, in its order."""
        if method not in MIRRORED:
            raise EngineError(f"a sharded group's member does not run Engine.{method}")
        out = self._call("", lambda eng: getattr(eng, method)(*args, **kwargs))
        return None if method != "optim_step_many" else out

    def shard_gather_seconds(self, repeats: int) -> float:
        """One pass of the group's all-gathers, timed (:func:`~opentinker.cluster.shard.gather_seconds`;
        every member at once)."""
        return self._call("", lambda eng: gather_seconds(eng.base.model, repeats))

    def rss_bytes(self, trim: bool = False) -> dict[str, int]:
        """This process's resident memory now and at its peak (bytes; benchmarks read it);
        ``trim``: after handing freed heap pages back to the system first."""
        import resource

        if trim:
            release_host_memory()

        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return {"rss": rss, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self._groups.clear()


def _process_group(store: Any, rank: int, world: int, device: str) -> Any:
    """A process group of ``world`` members over ``store``, this one ``rank``: NCCL where the
    worker's device is a GPU, gloo on CPU. Made directly, not through a default group, so each
    data-parallel model has a group of its replicas alone."""
    if torch.device(device).type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, world)  # type: ignore[attr-defined]
    return dist.ProcessGroupGloo(store, rank, world, COLLECTIVE_TIMEOUT)


def _take_rest(eng: Engine, model_id: str, folder: Path, *, gradients: bool) -> None:
    """Put what a handover saved in ``folder`` beside the state just loaded into ``model_id``:
    its lineage (snapshot count, parent) and, if ``gradients``, its pending gradients."""
    lineage = read_manifest(folder / "state")["meta"].get("lineage", {})
    if gradients and (folder / "gradients").exists():
        files, _ = read_checkpoint(folder / "gradients")
        eng.set_pending_gradients(model_id, files[GRADIENTS_FILE])
    eng.set_adapter_lineage(model_id, versions=int(lineage.get("versions", 0)), parent=lineage.get("parent"))


def _local_bytes(model: Any) -> int:
    """Bytes of the base weights this process holds (a sharded weight: its local shard)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _cpu_result(res: ForwardResult) -> ForwardResult:
    """The result with CPU tensors (a GPU worker's tensors would pin device memory in transit)."""
    outputs = [{k: v.detach().cpu() for k, v in out.items()} for out in res.outputs]
    return ForwardResult(outputs, dict(res.metrics))
