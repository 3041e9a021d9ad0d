"""Lean internal types of the engine API (plain tensors; no ``tinker`` objects at this layer).

The client and server layers translate ``tinker.types`` objects into these. Shape suffixes: T is a
datum's length (= number of targets), K the number of soft targets per position.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from opentinker.models.vision import Image

# Who a row runs through: a live adapter id, a snapshot id (``"<adapter>@v<n>"``), or None (bare base).
PolicyRef = str | None


class EngineError(ValueError):
    """A request the engine refuses. The message names the problem; no state was changed."""


class UnknownPolicyError(EngineError, KeyError):
    """An adapter or snapshot id the engine does not have (deleted, retired, or never created)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class Example:
    """One Tinker datum: ``tokens_T`` is the model input; ``inputs`` the loss inputs (each [T] or [T, K]).

    Position ``i`` of ``tokens_T`` predicts ``inputs["target_tokens"][i]``.
    """

    tokens_T: torch.Tensor  # int64 [T]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    # a VL model's images, in token order; each is ``n_tokens`` placeholder ids in ``tokens_T``
    images: tuple[Image, ...] = ()


class CustomLoss(Protocol):
    """A per-datum loss the engine runs in place of a built-in one (``engine/custom_loss.py``)."""

    @property
    def input_names(self) -> tuple[str, ...]: ...

    def check_datum(
        self, where: str, logprobs_shape: Sequence[int], inputs: Mapping[str, torch.Tensor]
    ) -> None: ...

    def __call__(
        self, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


@dataclass(frozen=True)
class ForwardRequest:
    """A batch of examples for one policy, with one loss; ``backward`` accumulates gradients."""

    policy: PolicyRef
    examples: list[Example]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float] = field(default_factory=dict)
    backward: bool = True
    custom_loss: CustomLoss | None = None  # the checked graph, when loss_fn is "custom"


@dataclass
class ForwardResult:
    """Per example: ``logprobs`` of the targets ([T] or [T, K]) and ``elementwise_loss`` ([T]).

    ``metrics`` use Tinker's ``name:reduction`` keys (``loss:sum``, ...).
    """

    outputs: list[dict[str, torch.Tensor]]
    metrics: dict[str, float]


@dataclass(frozen=True)
class AdamParams:
    """Tinker's AdamW hyper-parameters and defaults (decoupled weight decay; clip 0 = off)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def validate(self) -> None:
        checks = {
            "learning_rate": self.learning_rate >= 0,
            "beta1": 0 <= self.beta1 < 1,
            "beta2": 0 <= self.beta2 < 1,
            "eps": self.eps > 0,  # 0 divides 0 by 0 wherever a gradient is 0 (LoRA B starts so)
            "weight_decay": self.weight_decay >= 0,
            "grad_clip_norm": self.grad_clip_norm >= 0,
        }
        for name, ok in checks.items():
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or not ok:
                raise EngineError(f"AdamParams.{name}={value!r} is out of range ({_RANGES[name]})")


_RANGES = {
    "learning_rate": "a finite number >= 0",
    "beta1": "in [0, 1)",
    "beta2": "in [0, 1)",
    "eps": "a finite number > 0",
    "weight_decay": "a finite number >= 0",
    "grad_clip_norm": "a finite number >= 0; 0 = off",
}


@dataclass(frozen=True)
class SnapshotInfo:
    """An immutable policy version: a copy of one adapter's weights at one training step."""

    snapshot_id: str
    adapter_id: str
    version: int
    step: int
    nbytes: int
