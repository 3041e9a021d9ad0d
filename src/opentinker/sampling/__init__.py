"""Rollout sampling: the backend contract and the native KV-cache backend (mixed policies per batch)."""

from opentinker.sampling.backend import SamplingBackend
from opentinker.sampling.handles import SampleCancelled, SampleHandle
from opentinker.sampling.native import NativeBackend
from opentinker.sampling.types import SampledSequence, SampleRequest, SampleResult, SamplingParams

__all__ = [
    "NativeBackend",
    "SampleCancelled",
    "SampleHandle",
    "SampleRequest",
    "SampleResult",
    "SampledSequence",
    "SamplingBackend",
    "SamplingParams",
]
