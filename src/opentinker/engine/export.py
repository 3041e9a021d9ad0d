"""Export an adapter for other tools: PEFT's format, or a full HF model with the adapter merged in.

:func:`export_peft` writes ``adapter_model.safetensors`` + ``adapter_config.json``, what
``peft.PeftModel.from_pretrained(base, folder)`` and vLLM's ``LoRARequest`` load:

- keys ``base_model.model.<module path>.lora_A.weight`` [r, in] and ``.lora_B.weight`` [out, r]
  (PEFT's saved names: no adapter name in them; vLLM parses the module path out of the same keys);
- ``target_modules`` the short module names (``q_proj``, ``down_proj``, ``lm_head``), as PEFT's
  own configs and vLLM's supported-module checks expect, unless a short name would also match a
  module this adapter does not train, or, on a MoE model, is one that peft 0.21 rewrites into a
  fused experts parameter (``gate_proj``/``up_proj``/``down_proj`` of a dense first layer or a
  shared expert): then the full module paths, which PEFT matches exactly and leaves alone, so the
  folder loads in ``peft`` as shipped;
- routed experts (fused 3-D parameters, :mod:`opentinker.lora.experts`) through PEFT's
  ``target_parameters``: one ``ParamWrapper`` per targeted parameter, nested on the experts module
  in parameter order (the first innermost, under ``.base_layer``), with ``lora_A`` [r·E, in]
  (expert-major) and ``lora_B`` [out, r·E] (expert-minor), which is how PEFT 0.21 lays them out;
- ``r`` and ``lora_alpha`` giving the engine's own ``alpha / r`` scale; no rsLoRA, no DoRA, no bias;
- on a vision-language model, ``exclude_modules`` its vision tower and projector (they have
  projections of the same short names, which the engine never trains);
- ``base_model_name_or_path`` the base model's canonical name (an HF id such as
  ``HuggingFaceTB/SmolLM2-135M-Instruct``), never a folder of the machine that wrote it.

:func:`export_merged` loads the base model fresh (fp32) and adds ``scale * B @ A`` to each
targeted weight (transposed for GPT-2's ``Conv1D``), then saves it with ``save_pretrained``
(safetensors) and the tokenizer. A base whose unembedding is tied to its embedding stays tied: the
unembedding's delta goes on the shared matrix, in both roles, as the engine applies it
(docs/DESIGN.md, "Tied embeddings"); its PEFT export carries the pair on ``lm_head`` and, as
``lora_embedding_A``/``_B``, on the input embedding, with ``ensure_weight_tying``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from opentinker.lora import LoRAWeights, TargetGroup
from opentinker.lora.experts import EXPERT_PARAMS
from opentinker.lora.layers import VISION_MODULES

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"


# the module names peft 0.21 rewrites on a MoE model type whose weights transformers converts
# (``transformers_weight_conversion._MOE_TARGET_MODULE_MAPPING``): a bare ``gate_proj`` there is
# read as transformers 4's per-expert projection and turned into the fused ``gate_up_proj``
# parameter at twice the rank. A dense first layer's or a shared expert's projection of that name
# is written as its full path instead, which peft keeps as it is (no parameter has that path).
_PEFT_MOE_RENAMED = frozenset({"gate", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"})


def peft_target_modules(weights: LoRAWeights, groups: dict[str, TargetGroup]) -> list[str]:
    """Short module names where each one names only trained modules (and peft will not rewrite
    it on a MoE model), else the full paths of the modules under that name."""
    plain = {n: g for n, g in groups.items() if not g.experts}
    trained = sorted(n for n in weights.a if n in plain)
    short = {name: name.rsplit(".", 1)[-1].partition("@")[0] for name in plain}
    untrained = {short[n] for n in plain if n not in weights.a}
    moe = any(g.experts for g in groups.values())
    out: set[str] = set()
    for name in trained:
        if short[name] in untrained or (moe and short[name] in _PEFT_MOE_RENAMED):
            out.update(groups[name].paths)
        else:
            out.add(short[name])
    return sorted(out)


def export_peft(
    weights: LoRAWeights,
    groups: dict[str, TargetGroup],
    out_dir: str | Path,
    *,
    base_model: str,
    tied_embedding: str | None = None,
) -> Path:
    """``weights`` as a PEFT folder (module docstring); ``tied_embedding`` the input embedding's
    module path when it shares its matrix with the unembedding (the unembedding's LoRA then goes on
    it too, as PEFT's ``lora_embedding_A``/``_B``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    fan_in_fan_out = False
    for name in sorted(weights.a):
        group = groups[name]
        a, b = weights.a[name].detach(), weights.b[name].detach()
        if group.experts:
            tensors.update(_expert_tensors(name, a, b, groups, weights))
            continue
        for layer, path in enumerate(group.paths):
            tensors[f"base_model.model.{path}.lora_A.weight"] = a[layer].contiguous().cpu()
            tensors[f"base_model.model.{path}.lora_B.weight"] = b[layer].contiguous().cpu()
        fan_in_fan_out |= group.fan_in_fan_out
    embedding = _tied_embedding_tensors(weights, groups, tied_embedding)
    tensors.update(embedding)
    target_parameters = sorted(n for n in weights.a if groups[n].experts)
    modules = peft_target_modules(weights, groups)
    if embedding and tied_embedding is not None:
        modules.append(tied_embedding)
    save_file(tensors, str(out / PEFT_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": weights.rank,
        "lora_alpha": weights.config.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(modules) or None,
        "target_parameters": target_parameters or None,
        "fan_in_fan_out": fan_in_fan_out,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    if embedding:
        config["ensure_weight_tying"] = True
    if any(p.startswith("model.language_model.") for g in groups.values() for p in g.paths):
        # a VL model: its vision tower has projections of the same short names, never trained
        config["exclude_modules"] = rf".*\.({'|'.join(VISION_MODULES)})\..*"
    (out / PEFT_CONFIG).write_text(json.dumps(config, indent=2))
    return out


def _tied_embedding_tensors(
    weights: LoRAWeights, groups: dict[str, TargetGroup], path: str | None
) -> dict[str, torch.Tensor]:
    """The tied unembedding's LoRA on the input embedding, in PEFT's ``Embedding`` layout: its delta
    ``lora_embedding_B @ lora_embedding_A`` is [H, V], the transpose of the shared matrix's
    ``B A`` ([V, r] by [r, H]), so ``lora_embedding_A`` = B^T [r, V], ``lora_embedding_B`` = A^T."""
    unembed = [n for n in weights.a if groups[n].kind == "unembed"]
    if path is None or not unembed:
        return {}
    a, b = weights.a[unembed[0]].detach()[0], weights.b[unembed[0]].detach()[0]
    return {
        f"base_model.model.{path}.lora_embedding_A": b.T.contiguous().cpu(),
        f"base_model.model.{path}.lora_embedding_B": a.T.contiguous().cpu(),
    }


def _expert_tensors(
    name: str, a: torch.Tensor, b: torch.Tensor, groups: dict[str, TargetGroup], weights: LoRAWeights
) -> dict[str, torch.Tensor]:
    """PEFT's ``ParamWrapper`` tensors of one experts group (A [L, E, r, in], B [L, E, out, r])."""
    group = groups[name]
    # the experts module's targeted parameters, in its parameter order: the first is innermost
    here = _modules(group)
    siblings = [g.param for n, g in groups.items() if g.experts and n in weights.a and _modules(g) == here]
    siblings = [p for p in EXPERT_PARAMS if p in siblings or p == group.param]
    prefix = ".base_layer" * (len(siblings) - 1 - siblings.index(group.param))
    out = {}
    for layer, path in enumerate(group.paths):
        module = path.rpartition(".")[0]
        e, n_out, r = b[layer].shape
        out[f"base_model.model.{module}{prefix}.lora_A.weight"] = (
            a[layer].reshape(e * r, -1).contiguous().cpu()
        )
        out[f"base_model.model.{module}{prefix}.lora_B.weight"] = (
            b[layer].permute(1, 2, 0).reshape(n_out, r * e).contiguous().cpu()
        )
    return out


def _modules(group: TargetGroup) -> tuple[str, ...]:
    return tuple(p.rpartition(".")[0] for p in group.paths)


def merge_into(model: Any, weights: LoRAWeights, groups: dict[str, TargetGroup]) -> None:
    """Add the adapter's delta to ``model``'s weights in place (an HF model, not LoRA-wrapped)."""
    with torch.no_grad():
        for name in sorted(weights.a):
            group = groups[name]
            a, b = weights.a[name].detach(), weights.b[name].detach()
            if group.experts:
                for layer, path in enumerate(group.paths):
                    module_path, _, param = path.rpartition(".")
                    module = model.get_submodule(module_path)
                    w = getattr(module, param)  # [E, out, in] ([E, in, out] if transposed)
                    delta = weights.scale * (b[layer].to(w) @ a[layer].to(w))  # [E, out, in]
                    w.add_(delta.transpose(1, 2) if module.is_transposed else delta)
                continue
            for layer, path in enumerate(group.paths):
                w = model.get_submodule(path).weight  # [out, in] ([in, out] for Conv1D)
                delta = weights.scale * (b[layer].to(w) @ a[layer].to(w))  # [out, in]
                w.add_(delta.T if group.fan_in_fan_out else delta)


def export_merged(
    weights: LoRAWeights, groups: dict[str, TargetGroup], base_path: str, out_dir: str | Path
) -> Path:
    """A full HF model folder (safetensors, config, tokenizer) of the base with ``weights`` merged."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    merge_into(model, weights, groups)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(base_path).save_pretrained(str(out))
    return out
