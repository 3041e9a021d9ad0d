"""Load a base causal LM and its tokenizer, frozen, for the engine to wrap with LoRA layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from opentinker.models.registry import canonical_name, resolve_model_path


@dataclass
class BaseModel:
    """A frozen HF causal LM with its tokenizer; shared by every adapter of an engine."""

    name: str
    path: str
    model: Any  # a transformers PreTrainedModel (typed loosely: its stubs are incomplete)
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    vocab_size: int
    max_context: int

    @property
    def model_type(self) -> str:
        return str(getattr(self.model.config, "model_type", "unknown"))


def load_base_model(
    name: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> BaseModel:
    """Load ``name`` (built-in alias, local folder, or HF id in the local HF cache), frozen.

    The model is put in eval mode (no dropout: training and sampling see the same function) and
    every base parameter has ``requires_grad=False``; only LoRA weights are trained.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    canonical = canonical_name(name)
    path = resolve_model_path(canonical)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model.to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    config = model.config
    vocab = int(model.get_output_embeddings().weight.shape[0])
    max_context = int(
        getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 2048)
    )
    return BaseModel(
        name=canonical, path=path, model=model, tokenizer=tokenizer, vocab_size=vocab, max_context=max_context
    )
