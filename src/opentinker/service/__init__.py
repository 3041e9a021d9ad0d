"""The service: the one place model lifecycle, tenancy, checkpoints and scale-out are written.

Between the compute layers (``models`` … ``cluster``) and the front-ends (``client``: the embedded
SDK-shaped entry point; ``server``: the Tinker HTTP protocol). :class:`Runtime` owns one engine and
one scheduler per base model; :class:`TrainingClient` (one model) and :class:`SamplingClient` (one
immutable policy version) are the operations both front-ends call, in the SDK's types, so an
option behaves the same embedded and over HTTP.

The front-ends import nothing below this layer (``tests/test_layering.py``): the types of the
service's interface are exported here, so that they name them from here too: the errors its
methods raise (``EngineError`` and its kinds), what they take and return (``LoRAConfig``,
``SnapshotInfo``, a sample's ``SampleHandle`` and ``Submitted``), and ``canonical_name`` (the one spelling of a base model's name that models and
checkpoints record).
"""

from opentinker.engine import EngineError, SnapshotInfo, UnknownPolicyError
from opentinker.engine.checkpoint import CheckpointError
from opentinker.engine.paging import PageError, PagingFull
from opentinker.lora import LoRAConfig
from opentinker.models.registry import canonical_name
from opentinker.sampling import SampleCancelled, SampleHandle
from opentinker.service.runtime import Runtime, default_runtime
from opentinker.service.sampling import SamplingClient, Submitted
from opentinker.service.training import TrainingClient

__all__ = [
    "CheckpointError",
    "EngineError",
    "LoRAConfig",
    "PageError",
    "PagingFull",
    "Runtime",
    "SampleCancelled",
    "SampleHandle",
    "SamplingClient",
    "SnapshotInfo",
    "Submitted",
    "TrainingClient",
    "UnknownPolicyError",
    "canonical_name",
    "default_runtime",
]
