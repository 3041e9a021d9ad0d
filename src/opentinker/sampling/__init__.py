"""Rollout sampling: the backend contract and the native KV-cache backend (mixed policies per batch)."""

from opentinker.sampling.backend import SamplingBackend
from opentinker.sampling.loop import SampleCancelled
from opentinker.sampling.native import NativeBackend
from opentinker.sampling.types import SampledSequence, SampleRequest, SampleResult, SamplingParams

__all__ = [
    "NativeBackend",
    "SampleCancelled",
    "SampleRequest",
    "SampleResult",
    "SampledSequence",
    "SamplingBackend",
    "SamplingParams",
]
