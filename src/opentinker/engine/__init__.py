"""The engine: fused multi-adapter training, losses, per-adapter AdamW, snapshots, checkpoints, export."""

from opentinker.engine.checkpoint import CheckpointError
from opentinker.engine.engine import Engine
from opentinker.engine.losses import LOSSES
from opentinker.engine.trainer import DataParallelTrainer, Trainer
from opentinker.engine.types import (
    AdamParams,
    EngineError,
    Example,
    ForwardRequest,
    ForwardResult,
    PolicyRef,
    SnapshotInfo,
    UnknownPolicyError,
)

__all__ = [
    "LOSSES",
    "AdamParams",
    "CheckpointError",
    "DataParallelTrainer",
    "Engine",
    "EngineError",
    "Example",
    "ForwardRequest",
    "ForwardResult",
    "PolicyRef",
    "SnapshotInfo",
    "Trainer",
    "UnknownPolicyError",
]

_: type[Trainer] = Engine  # pyright checks that the engine is a Trainer (engine/trainer.py)
