"""OpenTinker: many LoRA policies post-trained over one shared base model, behind the Tinker API.

Layers, bottom-up (each imports only the ones before it): ``models`` (load a base causal LM),
``lora`` (multi-adapter layers), ``engine`` (fused training, losses, optimizer, snapshots,
checkpoints, export). See the README's file map.
"""

__version__ = "0.1.0"
