"""In-process clients with the ``tinker`` SDK's names, arguments and types (the engine runs embedded).

``ServiceClient`` and ``RestClient`` live here; the per-model ``TrainingClient`` and per-policy
``SamplingClient`` are the service layer's (:mod:`opentinker.service`), which the HTTP server
serves through too.
"""

from opentinker.client.service import ReleasesModels, RestClient, ServiceClient
from opentinker.service import Runtime, SamplingClient, TrainingClient, default_runtime

__all__ = [
    "ReleasesModels",
    "RestClient",
    "Runtime",
    "SamplingClient",
    "ServiceClient",
    "TrainingClient",
    "default_runtime",
]
