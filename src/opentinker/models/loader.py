"""Load a base causal LM and its tokenizer, frozen, for the engine to wrap with LoRA layers.

A folder that cannot be served is refused before any weight is read, with a
:class:`ModelLoadError` (a ``ValueError``: ``serve`` prints it and exits before its port opens; the
embedded runtime raises it when a client is created): a broken ``config.json`` (invalid JSON, no
``model_type``, a field of the wrong type) names the file and the field, never the server's
absolute path; a family transformers does not know, or one without a causal-LM head, names the
family.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opentinker.models.dtype import resolve_dtype
from opentinker.models.registry import canonical_name, resolve_model_path
from opentinker.models.vision import Vision

CONFIG_FILE = "config.json"
PROCESSOR_FILE = "preprocessor_config.json"  # a VL model's image processor, saved beside it


class ModelLoadError(ValueError):
    """A base model that cannot be served: the message names the file and field, or the family."""


@dataclass
class BaseModel:
    """A frozen HF causal LM with its tokenizer; shared by every adapter of an engine."""

    name: str
    path: str
    model: Any  # a transformers PreTrainedModel (typed loosely: its stubs are incomplete)
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    vocab_size: int
    max_context: int
    vision: Vision | None = None  # a vision-language model's image side (models/vision.py)

    @property
    def model_type(self) -> str:
        return str(getattr(self.model.config, "model_type", "unknown"))

    @property
    def dtype(self) -> torch.dtype:
        """The frozen base weights' dtype (LoRA weights are fp32 whatever this is)."""
        return next(self.model.parameters()).dtype


def load_base_model(
    name: str, *, dtype: str | torch.dtype | None = torch.float32, device: str | torch.device = "cpu"
) -> BaseModel:
    """Load ``name`` (built-in alias, local folder, or HF id in the local HF cache), frozen.

    ``dtype``: the base weights' dtype, ``float32``, ``bfloat16`` or ``auto`` (None): the device's
    default (:mod:`opentinker.models.dtype`). The model is put in eval mode (no dropout: training
    and sampling see the same function) and every base parameter has ``requires_grad=False``; only
    LoRA weights are trained. A model that cannot be served raises :class:`ModelLoadError`.
    ``device="meta"``: no weight is read; the parameters have no storage (a sharded group's
    member fills its own shard of them, :mod:`opentinker.cluster.shard_load`).
    """
    from transformers import AutoTokenizer

    torch_dtype = resolve_dtype(dtype, "cpu" if str(device) == "meta" else device)
    canonical = canonical_name(name)
    path = resolve_model_path(canonical)
    config = read_config(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    # a VL family with a causal-LM class (Qwen3.5) and no image processor saved loads text-only
    vl = is_vision_language(config) and (
        (Path(path) / PROCESSOR_FILE).is_file() or not _has_causal_lm(config)
    )
    try:
        vision = Vision.load(path, config) if vl else None
    except (ValueError, OSError) as e:
        raise ModelLoadError(_redact(" ".join(str(e).split()), path)) from None
    if str(device) == "meta":  # no weight read: parameters without storage, buffers computed
        model = _empty_model(config, vl, torch_dtype)
    else:
        model = model_class(config, vl).from_pretrained(
            path, config=config, dtype=torch_dtype, attn_implementation=attention_for(config, vl)
        )
        model.to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    config = model.config
    if vision is not None:
        vision.dtype = torch_dtype
    text = getattr(config, "text_config", None) if vision is not None else None
    vocab = int(model.get_output_embeddings().weight.shape[0])
    max_context = int(
        getattr(text or config, "max_position_embeddings", None) or getattr(config, "n_positions", 2048)
    )
    return BaseModel(
        name=canonical, path=path, model=model, tokenizer=tokenizer, vocab_size=vocab,
        max_context=max_context, vision=vision,
    )  # fmt: skip


def _empty_model(config: Any, vl: bool, dtype: torch.dtype) -> Any:
    """The model of ``config`` with its parameters on the meta device (shapes and dtypes, no
    storage) and its buffers (rotary frequencies) computed on the host, its tied weights tied:
    what a sharded group's member fills with its own shard of the weights."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = model_class(config, vl).from_config(
            config, dtype=dtype, attn_implementation=attention_for(config, vl)
        )
    model.tie_weights()
    return model


def is_vision_language(config: Any) -> bool:
    """Is ``config`` a vision-language model transformers has an image-text-to-text class for
    (Qwen2.5-VL, Qwen3-VL, Qwen3.5 with its vision tower)? Such a model loads with its vision
    tower (frozen, like the whole base), and its image processor."""
    from transformers import AutoModelForImageTextToText

    return getattr(config, "vision_config", None) is not None and (
        type(config) in AutoModelForImageTextToText._model_mapping
    )


def model_class(config: Any, vision: bool | None = None) -> Any:
    """The transformers auto class that loads ``config``: image-text-to-text for a VL model
    loaded with its vision tower (its language model's LoRA targets sit under
    ``model.language_model``), else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vl = is_vision_language(config) and (vision if vision is not None else not _has_causal_lm(config))
    return AutoModelForImageTextToText if vl else AutoModelForCausalLM


def _has_causal_lm(config: Any) -> bool:
    from transformers import AutoModelForCausalLM

    return type(config) in AutoModelForCausalLM._model_mapping


def read_config(path: str) -> Any:
    """The transformers config of model folder (or HF id) ``path``, checked: it parses, names a
    family transformers knows, and that family has a causal-LM class; else :class:`ModelLoadError`."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    folder = Path(path)
    if folder.is_dir():
        _check_config_json(folder / CONFIG_FILE)
    try:
        config = AutoConfig.from_pretrained(path)
    except StrictDataclassError as e:  # a field of the wrong type or value: the message names it
        detail = " ".join(str(e).split())
        field = re.match(r"Validation error for field '([^']+)': \w+: (?:Field '[^']+' )?(.*)", detail)
        if field is not None:
            detail = f"field '{field.group(1)}' is invalid: {field.group(2)}"
        raise ModelLoadError(f"{CONFIG_FILE}: {_redact(detail, path)}") from None
    except ValueError as e:
        family = re.search(r"model type `([^`]*)`", str(e))
        if family is None:
            raise ModelLoadError(f"{CONFIG_FILE}: {_redact(' '.join(str(e).split()), path)}") from None
        raise ModelLoadError(
            f"unsupported model family {family.group(1)!r} (model_type in {CONFIG_FILE}): "
            f"this version of transformers does not know that architecture"
        ) from None
    _check_causal_lm(config)
    return config


def _check_config_json(file: Path) -> None:
    """The checks transformers' own messages get wrong or word with the absolute path (it calls
    a config without ``model_type`` "not a valid JSON file")."""
    if not file.is_file():
        raise ModelLoadError(f"the model folder {file.parent.name!r} has no {CONFIG_FILE}")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ModelLoadError(f"{CONFIG_FILE} is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(
            f"{CONFIG_FILE} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
        ) from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{CONFIG_FILE} must hold a JSON object, got a {type(raw).__name__}")
    if "model_type" not in raw:
        raise ModelLoadError(f"{CONFIG_FILE} has no 'model_type' field (which model family this is)")
    if not isinstance(raw["model_type"], str) or not raw["model_type"]:
        raise ModelLoadError(
            f"{CONFIG_FILE}: field 'model_type' must be a non-empty string, got {raw['model_type']!r}"
        )


def _check_causal_lm(config: Any) -> None:

    if not _has_causal_lm(config) and not is_vision_language(config):
        raise ModelLoadError(
            f"unsupported model family {config.model_type!r}: transformers has no causal-LM class for "
            f"it ({type(config).__name__}); OpenTinker trains causal language models"
        )


def attention_for(config: Any, vision: bool | None = None) -> str:
    """The attention implementation to load with: PyTorch's SDPA where the family's model class
    supports it (fast on CPU and GPU), else ``eager`` (gpt-oss: its attention sinks have no SDPA
    path in transformers, and asking for SDPA is refused outright)."""
    cls = model_class(config, vision)._model_mapping[type(config)]
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def _redact(message: str, path: str) -> str:
    """``message`` without the model folder's absolute path (clients never see server paths)."""
    for form in (str(Path(path).resolve()), path):
        message = message.replace(form, "<model folder>")
    return message
