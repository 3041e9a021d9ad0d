"""Multi-LoRA layers: one frozen base model, many adapters, per-row routing inside one batch."""

from opentinker.lora.adapter import LoRAConfig, LoRAWeights, init_lora_weights
from opentinker.lora.layers import LoRABatch, MultiLoRA, MultiLoRALinear, TargetGroup

__all__ = [
    "LoRABatch",
    "LoRAConfig",
    "LoRAWeights",
    "MultiLoRA",
    "MultiLoRALinear",
    "TargetGroup",
    "init_lora_weights",
]
