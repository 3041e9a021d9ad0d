"""Rollout sampling: the backend contract and the native KV-cache backend (mixed policies per batch)."""

from opentinker.sampling.backend import RolloutBackend
from opentinker.sampling.native import NativeBackend
from opentinker.sampling.rollout import SampleCancelled
from opentinker.sampling.types import SampledSequence, SampleRequest, SampleResult, SamplingParams

__all__ = [
    "NativeBackend",
    "RolloutBackend",
    "SampleCancelled",
    "SampleRequest",
    "SampleResult",
    "SampledSequence",
    "SamplingParams",
]
