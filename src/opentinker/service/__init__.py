"""The service: the one place model lifecycle, tenancy, checkpoints and scale-out are written.

Between the compute layers (``models`` … ``cluster``) and the front-ends (``client``: the embedded
SDK-shaped entry point; ``server``: the Tinker HTTP protocol). :class:`Runtime` owns one engine and
one scheduler per base model; :class:`TrainingClient` (one model) and :class:`SamplingClient` (one
immutable policy version) are the operations both front-ends call, in the SDK's types, so an
option behaves the same embedded and over HTTP.
"""

from opentinker.service.runtime import Runtime, default_runtime
from opentinker.service.sampling import SamplingClient
from opentinker.service.training import TrainingClient

__all__ = ["Runtime", "SamplingClient", "TrainingClient", "default_runtime"]
