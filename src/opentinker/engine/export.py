"""Export an adapter in PEFT's format: ``adapter_model.safetensors`` + ``adapter_config.json``.

The result loads with ``peft.PeftModel.from_pretrained(base, folder)`` (and vLLM's LoRA loader):
keys ``base_model.model.<module path>.lora_A.weight`` [r, in] and ``.lora_B.weight`` [out, r],
``lora_alpha``/``r`` giving the same ``alpha / r`` scale the engine uses.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from opentinker.lora import LoRAWeights, TargetGroup


def export_peft(
    weights: LoRAWeights, groups: dict[str, TargetGroup], out_dir: str | Path, *, base_model: str
) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    targets: list[str] = []
    fan_in_fan_out = False
    for name in sorted(weights.a):
        group = groups[name]
        a, b = weights.a[name].detach(), weights.b[name].detach()
        for layer, path in enumerate(group.paths):
            tensors[f"base_model.model.{path}.lora_A.weight"] = a[layer].contiguous().cpu()
            tensors[f"base_model.model.{path}.lora_B.weight"] = b[layer].contiguous().cpu()
            targets.append(path)
        fan_in_fan_out |= group.fan_in_fan_out
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": weights.rank,
        "lora_alpha": weights.config.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": targets,
        "fan_in_fan_out": fan_in_fan_out,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
