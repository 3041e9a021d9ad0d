"""Multi-LoRA layers: one frozen base model, many adapters, per-row routing inside one batch."""

from opentinker.lora.adapter import LoRAConfig, LoRAWeights, TargetGroup, init_lora_weights
from opentinker.lora.layers import LoRABatch, MultiLoRA, MultiLoRAExperts, MultiLoRALinear

__all__ = [
    "LoRABatch",
    "LoRAConfig",
    "LoRAWeights",
    "MultiLoRA",
    "MultiLoRAExperts",
    "MultiLoRALinear",
    "TargetGroup",
    "init_lora_weights",
]
