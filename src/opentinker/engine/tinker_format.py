"""External weights in hosted Tinker's own adapter layout (what ``save_weights_external`` writes).

``tinker_cookbook.weights`` (``download``, then ``build_lora_adapter`` or ``build_hf_model``)
reads this layout; its converters document it (``tinker_cookbook/weights/_merge_utils.py``
``build_name_remaps`` / ``plan_expert_ops``, ``_merge.py`` ``MergeProfile``, ``_adapter.py``
``_expand_expert_weights``, and the README of ``tinker_cookbook/weights``, "Key Remapping"):

- ``adapter_model.safetensors``: for each trained projection, ``base_model.model.<HF module
  path>.lora_A.weight`` [r, in] and ``.lora_B.weight`` [out, r], unscaled (the converters multiply
  B by ``lora_alpha / r``);
- the unembedding under ``base_model.model.model.unembed_tokens`` (not ``lm_head``): the
  converters map it to ``lm_head`` when the base checkpoint has one, else (tied embeddings) onto
  ``model.embed_tokens``, the shared matrix in both its roles, which is how the engine applies
  it (docs/DESIGN.md, "Tied embeddings");
- routed experts as 3-D tensors under one key per projection of the experts module,
  ``<...>.experts.w1`` (gate), ``w3`` (up) and ``w2`` (down): A ``[E, r, in]``, B ``[E, out, r]``.
  A fused ``gate_up_proj`` is split into its gate and up rows (the halves ``[gate | up]``, or
  gpt-oss's interleaved ``[g0, u0, g1, u1, ...]`` when the experts module says
  ``is_concatenated=False``); both keep the pair's A. An ``up_proj`` without a gate is ``w3``;
- gpt-oss's attention under ``.attn`` (Tinker's name; the converters map it back to
  ``.self_attn``);
- ``adapter_config.json`` with ``r`` and ``lora_alpha`` (all the converters read), the base model's
  canonical name and the short names trained.

Our A/B are the engine's own (``opentinker.lora``): per target group ``A [L, r, in]``,
``B [L, out, r]``, and per expert ``A [L, E, r, in]``, ``B [L, E, out, r]``. PEFT's format, for
``peft`` and vLLM directly, stays :func:`opentinker.engine.export.export_peft`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from opentinker.lora import LoRAWeights, TargetGroup

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PREFIX = "base_model.model."
UNEMBED = "model.unembed_tokens"  # Tinker's name of the unembedding (lm_head)
# the experts module's fused parameter -> Tinker's projection names, in its output's order
EXPERT_NAMES = {"gate_up_proj": ("w1", "w3"), "up_proj": ("w3",), "down_proj": ("w2",)}


def export_tinker(
    weights: LoRAWeights,
    groups: dict[str, TargetGroup],
    out_dir: str | Path,
    *,
    base_model: str,
    model: Any,
) -> Path:
    """Write ``weights`` to ``out_dir`` in Tinker's layout (module docstring). ``model`` is the HF
    model the groups were made on (LoRA-wrapped or not): its experts modules' layout flags and its
    family (gpt-oss names attention ``attn``) decide the split and the names."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = tinker_tensors(weights, groups, model)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    trained = sorted({k.removeprefix(PREFIX).rsplit(".", 3)[-3] for k in tensors})
    config = {
        "base_model_name_or_path": base_model,
        "r": weights.rank,
        "lora_alpha": weights.config.alpha,
        "lora_dropout": 0.0,
        "use_rslora": False,
        "target_modules": trained,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out


def tinker_tensors(
    weights: LoRAWeights, groups: dict[str, TargetGroup], model: Any
) -> dict[str, torch.Tensor]:
    """``weights`` as the tensors of Tinker's ``adapter_model.safetensors``, by key (what
    :func:`export_tinker` writes; an upload of external weights is checked against it)."""
    rename = _attention_rename(model)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(weights.a):
        group = groups[name]
        a, b = weights.a[name].detach().cpu(), weights.b[name].detach().cpu()
        for layer, path in enumerate(group.paths):
            if group.experts:
                module_path = path.rpartition(".")[0]
                experts = _unwrapped(model.get_submodule(module_path))
                for proj, pa, pb in expert_pairs(group.param, a[layer], b[layer], experts):
                    _put(tensors, f"{module_path}.{proj}", pa, pb)
            elif group.kind == "unembed":
                _put(tensors, UNEMBED, a[layer], b[layer])
            else:
                _put(tensors, rename(path), a[layer], b[layer])
    return tensors


def expert_pairs(
    param: str, a: torch.Tensor, b: torch.Tensor, experts: Any
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """One layer's expert LoRA (A [E, r, in], B [E, out, r] on fused ``param``) as Tinker's
    ``(w1|w2|w3, A [E, r, in], B [E, out', r])``: a ``gate_up_proj`` split into gate and up rows."""
    if param not in EXPERT_NAMES:
        raise ValueError(f"no Tinker name for the expert parameter {param!r}")
    names = EXPERT_NAMES[param]
    if len(names) == 1:
        return [(names[0], a.contiguous(), b.contiguous())]
    n_out = b.shape[1]
    if n_out % 2:
        raise ValueError(f"{param} has an odd output size {n_out}: not a gate and up pair")
    if getattr(experts, "is_concatenated", True):
        gate, up = b[:, : n_out // 2], b[:, n_out // 2 :]  # [gate | up]
    else:
        gate, up = b[:, 0::2], b[:, 1::2]  # gpt-oss: [g0, u0, g1, u1, ...]
    return [
        (names[0], a.clone().contiguous(), gate.contiguous()),
        (names[1], a.clone().contiguous(), up.contiguous()),
    ]


def _put(tensors: dict[str, torch.Tensor], module: str, a: torch.Tensor, b: torch.Tensor) -> None:
    key = f"{PREFIX}{module}"
    if f"{key}.lora_A.weight" in tensors:
        raise ValueError(f"two LoRA pairs map to the Tinker key {key!r}")
    tensors[f"{key}.lora_A.weight"] = a.contiguous()
    tensors[f"{key}.lora_B.weight"] = b.contiguous()


def _unwrapped(module: Any) -> Any:
    """The HF experts module under the engine's LoRA wrapper (``MultiLoRAExperts.base``), if any."""
    inner = getattr(module, "base", None)
    return inner if isinstance(inner, torch.nn.Module) else module


def _attention_rename(model: Any) -> Any:
    """gpt-oss's attention is ``attn`` in Tinker's names (the converters' ``.attn`` -> ``.self_attn``)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", "") != "gpt_oss":
        return lambda path: path
    return lambda path: path.replace(".self_attn.", ".attn.")
