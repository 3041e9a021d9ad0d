"""OpenTinker: many LoRA policies post-trained over one shared base model, behind the Tinker API.

Layers, bottom-up (each imports only the ones before it): ``models`` (load a base causal LM),
``lora`` (multi-adapter layers), ``engine`` (fused training, losses, optimizer, snapshots,
checkpoints, export), ``sampling`` (sampling backends), ``scheduler`` (ticks, ordering, fairness),
``cluster`` (Ray), ``service`` (the ``Runtime``: model lifecycle, tenancy, checkpoints, scale-out),
``client`` (the SDK-shaped ``ServiceClient`` / ``TrainingClient`` / ``SamplingClient``, embedded).
See the README's folder map and docs/FILES.md.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentinker.client import RestClient, SamplingClient, ServiceClient, TrainingClient

__version__ = "0.1.0"
__all__ = ["RestClient", "SamplingClient", "ServiceClient", "TrainingClient", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: ``import opentinker.engine`` must not pull in the client layer (and the SDK).
    if name in ("RestClient", "SamplingClient", "ServiceClient", "TrainingClient"):
        from opentinker import client

        return getattr(client, name)
    raise AttributeError(name)
