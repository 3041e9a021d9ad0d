"""In-process clients with the ``tinker`` SDK's names, arguments and types (the engine runs embedded)."""

from opentinker.client.runtime import Runtime, default_runtime
from opentinker.client.sampling import SamplingClient
from opentinker.client.service import RestClient, ServiceClient
from opentinker.client.training import TrainingClient

__all__ = ["RestClient", "Runtime", "SamplingClient", "ServiceClient", "TrainingClient", "default_runtime"]
