"""The backend contract for rollout engines (the paper's "mixed-adapter rollout kernel" contract).

Everything above it (scheduler, clients, RL loops) talks to a :class:`RolloutBackend`:

- ``publish(policy_id, weights)``: make a policy version sampleable (an immutable LoRA snapshot);
- ``retire(policy_id)``: forget it (later requests naming it fail with a clear error);
- ``generate(requests)``: one batch whose requests may each name a different policy (or None, the
  bare base model), returning per request sampled tokens + logprobs + stop reasons, and prompt /
  top-k prompt logprobs when asked; a refused request yields an ``EngineError`` in its slot and
  never disturbs the others.

The native PyTorch backend (:mod:`opentinker.sampling.native`) shares the training engine's base
model and snapshots, so ``publish`` is free. A vLLM backend would implement the same three methods
with runtime LoRA loading (``publish`` = write the PEFT export, ``load_lora_adapter``), with no
change above this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from opentinker.engine.types import EngineError
from opentinker.lora import LoRAWeights
from opentinker.sampling.types import SampleRequest, SampleResult


class RolloutBackend(ABC):
    @abstractmethod
    def publish(self, policy_id: str, weights: LoRAWeights) -> None:
        """Make ``weights`` sampleable as ``policy_id`` (idempotent for the same id)."""

    @abstractmethod
    def retire(self, policy_id: str) -> None:
        """Stop serving ``policy_id``; raises ``UnknownPolicyError`` if it is not served."""

    @abstractmethod
    def generate(self, requests: list[SampleRequest]) -> list[SampleResult | EngineError]:
        """Sample every request in one mixed-policy batch; a bad request fails alone."""
