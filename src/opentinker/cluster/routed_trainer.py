"""What a queued call sees as its trainer when the models train on trainer workers:
:class:`RoutedTrainer`, a :class:`~opentinker.engine.trainer.Trainer` whose model operations run
on the trainer worker holding the model (in the model's order, through its router's lane), while
the base model and the policy versions samplers read are the front-end engine's.

A model's snapshot comes back as its tensors and is registered on the front-end engine, which
serves sampling; a snapshot, a checkpoint served as a policy, or the bare base model are read
there too. A data-parallel model (:mod:`opentinker.cluster.dp`) is routed by itself: reads are
replica 0's, loads go into every replica.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch

from opentinker.cluster.dp import DataParallelModel, shortfall
from opentinker.cluster.trainer import TrainerPool, WorkerSlot
from opentinker.engine import AdamParams, Engine, ForwardRequest, ForwardResult, SnapshotInfo
from opentinker.engine.trainer import DataParallelTrainer, Trainer
from opentinker.engine.types import PolicyRef
from opentinker.lora import LoRABatch, LoRAConfig, LoRAWeights, MultiLoRA
from opentinker.models import BaseModel


class Router(Protocol):
    """What a :class:`RoutedTrainer` needs of its router
    (:class:`~opentinker.cluster.trainer_router.RoutedScheduler`)."""

    engine: Engine  # the front-end's: the base model, the policy versions samplers read
    pool: TrainerPool
    dp: dict[str, DataParallelModel]

    def call(
        self, model_id: str, slot: WorkerSlot, method: str, *args: Any, ordered: bool = True, **kwargs: Any
    ) -> Any: ...
    def next_seq(self, model_id: str, slot: WorkerSlot) -> int: ...
    def note_step(self, model_id: str, step: int) -> None: ...
    def fresh(self) -> int: ...


class RoutedTrainer:
    """The trainer of the models on trainer workers, for a call queued on model ``key`` (whose
    own operations run in its order; see the module docstring)."""

    def __init__(self, router: Router, key: str) -> None:
        self._router, self._key = router, key
        self._local = router.engine
        self._pool = router.pool

    # ------------------------------------------------------------------ the front-end's engine
    @property
    def base(self) -> BaseModel:
        return self._local.base

    @property
    def device(self) -> torch.device:
        return self._local.device

    @property
    def lora(self) -> MultiLoRA:
        return self._local.lora

    @property
    def vocab_size(self) -> int:
        return self._local.vocab_size

    @property
    def max_context(self) -> int:
        return self._local.max_context

    @property
    def max_batch_tokens(self) -> int:
        return self._local.max_batch_tokens

    @property
    def data_parallel(self) -> DataParallelTrainer:
        return self

    def snapshot_ids(self) -> list[str]:
        return self._local.snapshot_ids()

    def snapshot_info(self, snapshot_id: str) -> SnapshotInfo:
        return self._local.snapshot_info(snapshot_id)

    def load_snapshot(self, path: str | Path, snapshot_id: str) -> SnapshotInfo:
        return self._local.load_snapshot(path, snapshot_id)

    def add_snapshot(
        self, snapshot_id: str, weights: LoRAWeights, *, adapter_id: str = "", step: int = 0
    ) -> SnapshotInfo:
        return self._local.add_snapshot(snapshot_id, weights, adapter_id=adapter_id, step=step)

    def release_snapshot(self, snapshot_id: str) -> None:
        self._local.release_snapshot(snapshot_id)

    def plan_routing(self, policies: list[PolicyRef]) -> LoRABatch | None:
        return self._local.plan_routing(policies)

    @contextmanager
    def routing(self, policies: list[PolicyRef] | LoRABatch | None) -> Iterator[None]:
        with self._local.routing(policies):
            yield

    # ------------------------------------------------------------------ where things are
    def _placed(self, ref: str | None) -> WorkerSlot | None:
        """The worker of adapter ``ref`` if a worker holds it (a lost one raises), else None."""
        return self._pool.worker_of(ref) if ref is not None and self._pool.is_placed(ref) else None

    def _dp(self, ref: str | None) -> DataParallelModel | None:
        """The data-parallel model ``ref``, if it is one."""
        return None if ref is None else self._router.dp.get(ref)

    def _remote(self, model_id: str, method: str, *args: Any, **kwargs: Any) -> Any:
        dp = self._dp(model_id)
        if dp is not None:  # a read: replica 0's (the replicas are the same)
            return dp.read(method, *args, **kwargs)
        slot = self._pool.worker_of(model_id)
        return self._router.call(model_id, slot, method, *args, ordered=model_id == self._key, **kwargs)

    def _placed_call(self, model_id: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` creating ``model_id`` on a newly chosen worker; the placement is undone if it fails."""
        slot = self._pool.place(model_id)
        try:
            return self._router.call(model_id, slot, method, *args, **kwargs)
        except Exception:
            self._pool.forget(model_id)
            raise

    # ------------------------------------------------------------------ adapters
    def create_adapter(self, config: Any, adapter_id: str | None = None) -> str:
        if adapter_id is None:
            adapter_id = f"adapter-routed-{self._router.fresh()}"
        out = self._placed_call(adapter_id, "create_adapter", config, adapter_id)
        self._router.note_step(adapter_id, 0)
        return out

    def create_data_parallel(self, config: LoRAConfig, adapter_id: str, degree: int) -> str:
        """A fresh adapter replicated over ``degree`` trainer workers (:mod:`opentinker.cluster.dp`)."""
        if config.seed is None:  # every replica starts from the same weights: one seed for all
            config = dataclasses.replace(config, seed=secrets.randbelow(2**31))
        self._router.dp[adapter_id] = DataParallelModel(self._pool, adapter_id, config, degree=degree)
        self._router.note_step(adapter_id, 0)
        return adapter_id

    def data_parallel_shortfall(self, degree: int) -> str | None:
        """Why a new data-parallel model of ``degree`` cannot be made now (None: it can)."""
        return shortfall(self._pool, degree)

    def load_data_parallel(self, path: Any, adapter_id: str, degree: int, *, optimizer: bool) -> str:
        """Adapter ``adapter_id`` from the checkpoint at ``path`` (storage every worker reads),
        replicated over ``degree`` trainer workers, each loading it."""
        dp = DataParallelModel(
            self._pool, adapter_id, None, degree=degree, checkpoint=str(path), optimizer=optimizer
        )
        self._router.dp[adapter_id] = dp
        self._router.note_step(adapter_id, int(dp.read("adapter_step", adapter_id)))
        return adapter_id

    def load_state(
        self, path: Any, *, adapter_id: str | None = None, optimizer: bool = True, into: str | None = None
    ) -> str:
        if into is not None:
            dp = self._dp(into)
            if dp is not None:
                return dp.load(str(path), optimizer=optimizer)
            return self._remote(into, "load_state", path, optimizer=optimizer, into=into)
        aid = adapter_id or f"adapter-routed-{self._router.fresh()}"
        out = self._placed_call(aid, "load_state", path, adapter_id=aid, optimizer=optimizer)
        self._router.note_step(aid, int(self._remote(aid, "adapter_step", aid)))
        return out

    def fork_adapter(
        self,
        source: str,
        adapter_id: str | None = None,
        *,
        into: str | None = None,
        parent: str | None = None,
    ) -> str:
        src_slot = self._placed(source)
        if src_slot is not None or self._dp(source) is not None:
            weights = self._remote(source, "adapter_weights", source)
            step = int(self._remote(source, "adapter_step", source))
        else:
            weights = self._local.adapter_weights(source).clone(device="cpu")
            step = self._local.snapshot_info(source).step
        if into is not None:
            dp = self._dp(into)
            if dp is not None:
                dp.adopt(weights, step=step, parent=parent or source)
                self._router.note_step(into, step)
                return into
            slot = self._pool.worker_of(into)
            seq = self._router.next_seq(into, slot)
            ref = slot.actor.adopt.remote(into, seq, weights, step=step, parent=parent or source, into=True)
            out = self._pool.get(slot, into, ref)
            self._router.note_step(into, step)
            return out
        aid = adapter_id or f"adapter-routed-{self._router.fresh()}"
        slot = self._pool.place(aid)
        try:
            seq = self._router.next_seq(aid, slot)
            ref = slot.actor.adopt.remote(aid, seq, weights, step=step, parent=parent or source, into=False)
            out = self._pool.get(slot, aid, ref)
            self._router.note_step(aid, step)
            return out
        except Exception:
            self._pool.forget(aid)
            raise

    def delete_adapter(self, adapter_id: str) -> None:
        dp = self._router.dp.pop(adapter_id, None)
        if dp is not None:
            dp.delete()
            return
        self._remote(adapter_id, "delete_adapter", adapter_id)
        self._pool.forget(adapter_id)

    def has_adapter(self, adapter_id: str) -> bool:
        return self._dp(adapter_id) is not None or self._placed(adapter_id) is not None

    def adapter_ids(self) -> list[str]:
        return sorted([*self._pool.placement(), *self._router.dp])

    def snapshot(self, adapter_id: str) -> SnapshotInfo:
        """The worker's snapshot, its tensors registered on the front-end engine for sampling."""
        dp = self._dp(adapter_id)
        if dp is not None:
            info, weights = dp.snapshot()
        else:
            slot = self._pool.worker_of(adapter_id)
            seq = self._router.next_seq(adapter_id, slot)
            info, weights = self._pool.get(slot, adapter_id, slot.actor.snapshot.remote(adapter_id, seq))
        sid = info.snapshot_id
        while sid in self._local.snapshot_ids():  # a restored model counts its versions afresh
            sid = f"{info.snapshot_id}.{self._router.fresh()}"
        self._local.add_snapshot(sid, weights, adapter_id=adapter_id, step=info.step)
        return dataclasses.replace(info, snapshot_id=sid)

    def check_policy(self, ref: str | None) -> None:
        if self._dp(ref) is None and self._placed(ref) is None:
            self._local.check_policy(ref)

    def _on_holder(self, method: str, ref: str | None, *args: Any, **kwargs: Any) -> Any:
        """``method`` on the worker holding adapter ``ref``, or on the front-end's engine for a
        policy version (a snapshot) or the bare base model."""
        if self._dp(ref) is not None or self._placed(ref) is not None:
            assert ref is not None
            return self._remote(ref, method, ref, *args, **kwargs)
        return getattr(self._local, method)(ref, *args, **kwargs)

    def adapter_weights(self, ref: PolicyRef) -> LoRAWeights:
        return self._on_holder("adapter_weights", ref)

    def save_state(
        self,
        ref: PolicyRef,
        path: str | Path,
        *,
        optimizer: bool = True,
        meta: dict[str, Any] | None = None,
        overwrite: bool = False,
    ) -> Path:
        return self._on_holder("save_state", ref, path, optimizer=optimizer, meta=meta, overwrite=overwrite)

    def export_peft(self, ref: PolicyRef, out_dir: str | Path) -> Path:
        return self._on_holder("export_peft", ref, out_dir)

    def export_tinker(self, ref: PolicyRef, out_dir: str | Path) -> Path:
        return self._on_holder("export_tinker", ref, out_dir)

    def export_merged(self, ref: PolicyRef, out_dir: str | Path) -> Path:
        return self._on_holder("export_merged", ref, out_dir)

    def adapter_config(self, adapter_id: str) -> LoRAConfig:
        return self._on_holder("adapter_config", adapter_id)

    def adapter_step(self, adapter_id: str) -> int:
        return self._remote(adapter_id, "adapter_step", adapter_id)

    def optimizer_state(self, adapter_id: str) -> dict[str, torch.Tensor]:
        return self._remote(adapter_id, "optimizer_state", adapter_id)

    def pending_gradients(self, adapter_id: str) -> dict[str, torch.Tensor] | None:
        return self._remote(adapter_id, "pending_gradients", adapter_id)

    def optim_step(self, adapter_id: str, params: AdamParams) -> dict[str, float]:
        dp = self._dp(adapter_id)
        if dp is not None:
            return dp.optim_step(params)
        return self._remote(adapter_id, "optim_step", adapter_id, params)

    def forward_backward(self, req: ForwardRequest) -> ForwardResult:
        dp = self._dp(req.policy)
        if dp is not None:
            return dp.forward_request(req)
        if self._placed(req.policy) is None:
            return self._local.forward_backward(req)
        assert req.policy is not None
        return self._remote(req.policy, "forward_backward", req)


_: type[Trainer] = RoutedTrainer  # pyright checks that it is a Trainer
