"""The trainer seam: what a queued call (``Scheduler.submit_call``: save, load, snapshot, fork,
delete, export, ...) and the clients call on a base model's trainer.

Two classes implement :class:`Trainer`, and pyright checks both (the assignments at the end of
:mod:`opentinker.engine.engine` and :mod:`opentinker.cluster.routed_trainer`):

- :class:`~opentinker.engine.Engine`, which trains every model in this process;
- ``opentinker.cluster.routed_trainer.RoutedTrainer``, what a call sees when the models train on
  trainer workers: a model's operations run on the worker holding it, in the model's order, while
  the base model and the policy versions samplers read are the front-end engine's.

The scheduler's own ticks call ``Engine.forward_backward_many`` and ``Engine.optim_step_many`` on
its engine; those are not part of the seam. :attr:`Trainer.data_parallel` says whether models can
be replicated over trainer workers (:class:`DataParallelTrainer`), None where they cannot.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch

from opentinker.engine.types import AdamParams, ForwardRequest, ForwardResult, PolicyRef, SnapshotInfo
from opentinker.lora import LoRABatch, LoRAConfig, LoRAWeights, MultiLoRA
from opentinker.models import BaseModel


class DataParallelTrainer(Protocol):
    """Models replicated over trainer workers (:mod:`opentinker.cluster.dp`)."""

    def create_data_parallel(self, config: LoRAConfig, adapter_id: str, degree: int) -> str:
        """A fresh adapter replicated over ``degree`` trainer workers."""
        ...

    def load_data_parallel(self, path: str | Path, adapter_id: str, degree: int, *, optimizer: bool) -> str:
        """Adapter ``adapter_id`` from the checkpoint at ``path``, replicated over ``degree`` workers."""
        ...

    def data_parallel_shortfall(self, degree: int) -> str | None:
        """Why a new data-parallel model of ``degree`` cannot be made now (None: it can)."""
        ...


class Trainer(Protocol):
    """A base model's trainer as its queued calls see it (see the module docstring)."""

    # ------------------------------------------------------------------ the base model
    @property
    def base(self) -> BaseModel: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def lora(self) -> MultiLoRA: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_context(self) -> int: ...
    @property
    def max_batch_tokens(self) -> int: ...
    @property
    def data_parallel(self) -> DataParallelTrainer | None: ...

    # ------------------------------------------------------------------ models
    def create_adapter(self, config: LoRAConfig, adapter_id: str | None = None) -> str: ...
    def fork_adapter(
        self,
        source: str,
        adapter_id: str | None = None,
        *,
        into: str | None = None,
        parent: str | None = None,
    ) -> str: ...
    def delete_adapter(self, adapter_id: str) -> None: ...
    def has_adapter(self, adapter_id: str) -> bool: ...
    def adapter_ids(self) -> list[str]: ...
    def adapter_config(self, adapter_id: str) -> LoRAConfig: ...
    def adapter_step(self, adapter_id: str) -> int: ...
    def adapter_weights(self, ref: PolicyRef) -> LoRAWeights: ...
    def optimizer_state(self, adapter_id: str) -> dict[str, torch.Tensor]: ...
    def pending_gradients(self, adapter_id: str) -> dict[str, torch.Tensor] | None: ...
    def check_policy(self, ref: PolicyRef) -> None: ...

    # ------------------------------------------------------------------ training, one call
    def forward_backward(self, req: ForwardRequest) -> ForwardResult: ...
    def optim_step(self, adapter_id: str, params: AdamParams) -> dict[str, float]: ...

    # ------------------------------------------------------------------ snapshots
    def snapshot(self, adapter_id: str) -> SnapshotInfo: ...
    def snapshot_info(self, snapshot_id: str) -> SnapshotInfo: ...
    def snapshot_ids(self) -> list[str]: ...
    def release_snapshot(self, snapshot_id: str) -> None: ...
    def add_snapshot(
        self, snapshot_id: str, weights: LoRAWeights, *, adapter_id: str = "", step: int = 0
    ) -> SnapshotInfo: ...
    def load_snapshot(self, path: str | Path, snapshot_id: str) -> SnapshotInfo: ...
    def plan_routing(self, policies: list[PolicyRef]) -> LoRABatch | None: ...
    def routing(self, policies: list[PolicyRef] | LoRABatch | None) -> AbstractContextManager[None]: ...

    # ------------------------------------------------------------------ checkpoints and exports
    def save_state(
        self,
        ref: PolicyRef,
        path: str | Path,
        *,
        optimizer: bool = True,
        meta: dict[str, Any] | None = None,
        overwrite: bool = False,
    ) -> Path: ...
    def load_state(
        self,
        path: str | Path,
        *,
        adapter_id: str | None = None,
        optimizer: bool = True,
        into: str | None = None,
    ) -> str: ...
    def export_peft(self, ref: PolicyRef, out_dir: str | Path) -> Path: ...
    def export_tinker(self, ref: PolicyRef, out_dir: str | Path) -> Path: ...
    def export_merged(self, ref: PolicyRef, out_dir: str | Path) -> Path: ...
